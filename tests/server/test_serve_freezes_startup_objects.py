"""`serve` freezes what startup made before it serves: a full garbage collection then walks only what
serving allocates, not the model's, the tokenizer's and the libraries' objects (about 200,000, 136 ms a
collection with a 262,144-token vocabulary, during which every stream stalls)."""

import gc
from collections.abc import Callable
from typing import Any

import pytest
import uvicorn

import kvserve.server.app
from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.options import ServerOptions


def test_serve_freezes_the_startup_objects_before_it_serves(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, make_tiny_engine: Callable[..., Engine]
) -> None:
    frozen_at_run: list[int] = []
    started: list[AsyncEngine] = []

    class RecordedAsyncEngine(AsyncEngine):
        def __init__(self, engine: Engine) -> None:
            super().__init__(engine)
            started.append(self)

    def run(self: uvicorn.Server, *args: Any, **kwargs: Any) -> None:
        frozen_at_run.append(gc.get_freeze_count())

    engine = make_tiny_engine()
    gc.unfreeze()
    monkeypatch.setattr(Engine, "from_config", staticmethod(lambda config, **_: engine))
    monkeypatch.setattr(kvserve.server.app, "AsyncEngine", RecordedAsyncEngine)
    monkeypatch.setattr(uvicorn.Server, "run", run)
    try:
        kvserve.server.app.serve(EngineConfig(cache_dir=str(tmp_path)), ServerOptions(port=0))
    finally:
        gc.unfreeze()
        for async_engine in started:
            async_engine.shutdown()
    # Everything alive when serving began: the session's models and modules, tens of thousands at least.
    assert frozen_at_run and frozen_at_run[0] > 10_000
