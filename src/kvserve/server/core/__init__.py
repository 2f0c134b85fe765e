"""The neutral core every API converts to: a chat request, its plan, prompts, tools, reasoning and
generation."""
