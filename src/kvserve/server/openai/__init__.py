"""OpenAI's chat and text completions: protocol, conversion to the neutral request, output formats."""
