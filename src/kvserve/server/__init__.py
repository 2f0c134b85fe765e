"""OpenAI-compatible HTTP server: `kvserve serve`, or `create_app(async_engine, options)` to embed it."""
