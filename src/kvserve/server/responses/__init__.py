"""OpenAI's Responses API: protocol, conversion, stream writer, and its store with persistence."""
