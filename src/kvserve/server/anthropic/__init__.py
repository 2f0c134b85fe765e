"""Anthropic's Messages API: protocol, conversion to the neutral request, stream writer."""
