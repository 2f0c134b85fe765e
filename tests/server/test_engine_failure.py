"""When the engine thread fails: requests in flight get a clear 500, /health turns 503, nothing hangs,
the failure is logged with its traceback, and `kvserve serve` exits non-zero for its supervisor. An idle
engine thread sleeps instead of spinning."""

import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import httpx
import pytest
from fastapi import FastAPI

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from tests.helpers import free_port, server_process

SMALL = {"kv_cache_memory": 32 * 2**20, "max_model_len": 512}


def _fail_after(engine: Engine, steps: int) -> None:
    """Make the engine's step raise once it has run `steps` times, as a bug would."""
    original = engine.step
    count = 0

    def step() -> list:  # type: ignore[type-arg]
        nonlocal count
        count += 1
        if count > steps:
            raise RuntimeError("simulated engine bug")
        return original()

    engine.step = step  # type: ignore[method-assign]


@pytest.fixture()
def failing_server(
    make_engine: Callable[..., Engine], serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[tuple[str, AsyncEngine, list[BaseException]]]:
    engine = make_engine(**SMALL)
    failures: list[BaseException] = []
    async_engine = AsyncEngine(engine, on_failure=failures.append)
    with serve_app(create_app(async_engine, ServerOptions())) as url:
        yield url, async_engine, failures


def test_a_failing_engine_fails_requests_in_flight_with_500_and_health_with_503(
    failing_server: tuple[str, AsyncEngine, list[BaseException]], caplog: pytest.LogCaptureFixture
) -> None:
    url, async_engine, failures = failing_server
    assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    _fail_after(async_engine.engine, 3)
    body = {"prompt": "Once upon a time", "max_tokens": 50, "ignore_eos": True}
    results: list[httpx.Response] = []
    # Several requests in flight at once: every one of them must get an answer.
    threads = [
        threading.Thread(
            target=lambda: results.append(httpx.post(f"{url}/v1/completions", json=body, timeout=60))
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert len(results) == 3
    for r in results:
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert error["code"] == "engine_failed" and "Traceback" not in r.text
    assert len(failures) == 1 and isinstance(failures[0], RuntimeError)
    assert any("simulated engine bug" in (rec.exc_text or "") for rec in caplog.records)
    health = httpx.get(f"{url}/health", timeout=30)
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_failed"
    # Later requests fail at once instead of waiting on a dead engine.
    later = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert later.status_code == 500
    metrics = httpx.get(f"{url}/metrics", timeout=30)
    assert metrics.status_code in (500, 503)


def _thread_cpu_seconds(native_id: int) -> float:
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
def test_an_idle_engine_thread_does_not_spin(make_engine: Callable[..., Engine]) -> None:
    async_engine = AsyncEngine(make_engine(**SMALL))
    try:
        native_id = async_engine._thread.native_id
        assert native_id is not None
        before = _thread_cpu_seconds(native_id)
        time.sleep(1.0)
        # CPU time, not wall time: a thread blocked on its queue uses none; a spinning one uses ~1 s.
        assert _thread_cpu_seconds(native_id) - before < 0.2
    finally:
        async_engine.shutdown()


def test_a_call_cancelled_before_it_runs_is_skipped_not_fatal(make_engine: Callable[..., Engine]) -> None:
    """A caller that stops waiting (a /health timeout) cancelled its call's future; the engine thread
    then raised completing it and stopped for everyone."""
    async_engine = AsyncEngine(make_engine(**SMALL))
    busy, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def hold(_: Engine) -> None:
        busy.set()
        release.wait(60)

    async def scenario() -> None:
        first = asyncio.ensure_future(async_engine.call(hold))
        assert await asyncio.to_thread(busy.wait, 60)
        # Queued behind `hold`, so it is cancelled before the engine thread picks it up.
        cancelled = asyncio.ensure_future(async_engine.call(lambda e: ran.append("cancelled")))
        await asyncio.sleep(0)
        cancelled.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await cancelled
        release.set()
        await first
        assert await async_engine.call(lambda e: "alive") == "alive"

    try:
        asyncio.run(scenario())
        assert async_engine.failure is None
        assert ran == []
    finally:
        release.set()
        async_engine.shutdown()


INJECT = """
import sys
from kvserve.engine.engine import Engine
original = Engine.step
calls = [0]
def step(self):
    if self.has_unfinished_requests():
        calls[0] += 1
        if calls[0] > 2:
            raise RuntimeError("simulated engine bug")
    return original(self)
Engine.step = step
from kvserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_serve_exits_non_zero_when_the_engine_fails() -> None:
    port = free_port()
    args = ["serve", "--port", str(port), "--kv-cache-memory", "32MiB", "--max-model-len", "512"]
    with server_process([sys.executable, "-c", INJECT, *args], port) as (process, url):
        body = {"prompt": "Once upon a time", "max_tokens": 20, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_failed"
        output = process.communicate(timeout=60)[0].decode()
        assert process.returncode == 1, output
        assert "simulated engine bug" in output and "Traceback" in output
