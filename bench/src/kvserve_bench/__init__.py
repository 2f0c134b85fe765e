"""kvserve bench: workloads that show what prefix caching is worth, run against OpenAI-compatible servers.

The bench layer talks HTTP only, so it measures kvserve, kvserve without its prefix cache, and any peer
server (vLLM, SGLang, ...) the same way.
"""
