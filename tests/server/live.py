"""A real server under test: its URL and its engine, and the no-leak check read from its stats."""

import asyncio
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from benchmarks.agents import FIXTURES, build_model
from fastapi import FastAPI

from kvserve.config import EngineConfig, default_cache_dir
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine, EngineStats
from kvserve.model.loader import load_model
from kvserve.options import ServerOptions
from kvserve.server.app import create_app


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


def recorded_request(name: str) -> dict[str, Any]:
    """An agent CLI's first request as `make agents --fixtures` recorded it: method, path, headers, body."""
    with open(os.path.join(FIXTURES, f"{name}.json")) as f:
        fixture: dict[str, Any] = json.load(f)
    return fixture


@contextmanager
def agents_server(
    folder: str, serve_app: Callable[[FastAPI], AbstractContextManager[str]], key: str, alias: str
) -> Iterator[Server]:
    """A real server on the agents' long-context tiny model (a 32,768-token context), as `make agents`
    serves it: behind `key`, with the CLI's own default model id `alias` served as an alias."""
    model = load_model(build_model(folder), default_cache_dir())
    engine = Engine.from_config(EngineConfig(kv_cache_memory=64 * 2**20, max_model_len=32768), model=model)
    async_engine = AsyncEngine(engine)
    options = ServerOptions(api_key=key, served_model_name=("kvserve-agents", alias))
    with serve_app(create_app(async_engine, options)) as url:
        yield Server(url, async_engine)
