"""Regression: a /health probe that timed out while the engine was busy (a long prefill on a loaded
machine, as a router's health checks meet it) cancelled its command; when the engine thread came to
answer it, setting the result of the cancelled future raised InvalidStateError and killed the engine,
failing every request in flight and exiting the server."""

import asyncio
import contextlib
import time
from collections.abc import Callable

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine

SMALL = {"kv_cache_memory": 32 * 2**20, "max_model_len": 512}


def test_a_call_abandoned_by_its_caller_leaves_the_engine_running(make_engine: Callable[..., Engine]) -> None:
    async_engine = AsyncEngine(make_engine(**SMALL))

    async def probe() -> None:
        # The engine is busy for a second (as in a long step); the probe gives up after 0.1 s.
        busy = asyncio.ensure_future(async_engine.call(lambda engine: time.sleep(1.0)))
        await asyncio.sleep(0.05)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(async_engine.call(lambda engine: None), 0.1)
        await busy
        # The engine came to the abandoned call after the busy one, and is still answering.
        assert await asyncio.wait_for(async_engine.call(lambda engine: 42), 30) == 42

    try:
        asyncio.run(probe())
        assert async_engine.failure is None
    finally:
        async_engine.shutdown()
