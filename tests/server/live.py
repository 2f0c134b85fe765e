"""A real server under test: its URL and its engine, and the no-leak check read from its stats."""

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine, EngineStats


@dataclass
class Server:
    url: str
    async_engine: AsyncEngine

    def call(self, fn: Callable[[Engine], Any]) -> Any:
        return asyncio.run(self.async_engine.call(fn))

    def wait_idle(self, timeout_s: float = 60) -> EngineStats:
        """Stats once no request is in flight and no block is locked; fails if that never happens."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats: EngineStats = self.call(lambda e: e.stats())
            idle = stats.num_running == 0 and stats.num_waiting == 0 and stats.cache.num_locked == 0
            if idle and self.async_engine.num_in_flight == 0:
                return stats
            assert time.monotonic() < deadline, f"the engine never went idle: {stats}"
            time.sleep(0.05)


def assert_no_leak(stats: EngineStats) -> None:
    c = stats.cache
    assert c.num_locked == 0
    assert c.num_free + c.num_cached == c.num_blocks
