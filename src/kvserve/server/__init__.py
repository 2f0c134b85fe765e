"""OpenAI-compatible HTTP server: `kvserve serve`, or `create_app(async_engine)` to embed it."""
