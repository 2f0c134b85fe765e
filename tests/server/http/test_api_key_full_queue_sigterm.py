"""The server at its limits: an API key, a full queue, and SIGTERM with a stream in flight."""

import asyncio
import json
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager

import httpx
import openai
import pytest
from fastapi import FastAPI

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from tests.harness import gate_steps
from tests.helpers import free_port, server_process

SMALL = {"kv_cache_memory": 32 * 2**20, "max_model_len": 512}


def test_api_key_guards_every_route_but_health(
    make_engine: Callable[..., Engine], serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> None:
    with serve_app(create_app(AsyncEngine(make_engine(**SMALL)), ServerOptions(api_key="sesame-key"))) as url:
        for method, path in [
            ("GET", "/v1/models"),
            ("GET", "/version"),
            ("POST", "/tokenize"),
        ]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame-key"}):
                r = httpx.request(method, f"{url}{path}", headers=headers, json={"prompt": "x"})
                assert r.status_code == 401, (path, headers)
                error = r.json()["error"]
                assert error["code"] == "invalid_api_key" and "Authorization: Bearer" in error["message"]
        # Refused before the body is even looked at.
        assert httpx.post(f"{url}/v1/chat/completions", content=b"{").status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame-key", max_retries=0)
        completion = client.completions.create(
            model=client.models.list().data[0].id, prompt="Hi", max_tokens=2
        )
        assert completion.usage is not None and completion.usage.completion_tokens == 2
        # /metrics shows every tenant's rows: the admin key's, and the server has none.
        with_key = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer sesame-key"})
        assert with_key.status_code == 403


def test_full_queue_answers_503_with_retry_after(
    make_engine: Callable[..., Engine], serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> None:
    # One running and one waiting request fill this engine.
    async_engine = AsyncEngine(make_engine(**SMALL, max_num_seqs=1, max_waiting=1))
    body = {"prompt": "Count to a thousand:", "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def scenario(url: str) -> httpx.Response:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:

            async def hold() -> None:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass

            holders = [asyncio.create_task(hold()) for _ in range(2)]
            deadline = time.monotonic() + 60
            while async_engine.num_in_flight < 2:
                assert time.monotonic() < deadline and not any(h.done() for h in holders)
                await asyncio.sleep(0.02)
            refused = await client.post("/v1/completions", json=body)
            # Leaving aborts both, whether already streaming or still queued for their first token.
            for h in holders:
                h.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            return refused

    with serve_app(create_app(async_engine, ServerOptions())) as url:
        refused = asyncio.run(scenario(url))
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "overloaded"

        deadline = time.monotonic() + 60
        while True:
            stats = asyncio.run(async_engine.stats())
            if async_engine.num_in_flight == 0 and stats.num_running == stats.num_waiting == 0:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
        assert stats.cache.num_locked == 0
        assert stats.generation_tokens < 400
        # The server is fine afterwards.
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200


def test_a_request_waiting_for_its_first_token_counts_once_against_the_queue(
    make_engine: Callable[..., Engine],
    serve_app: Callable[[FastAPI], AbstractContextManager[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The room reserved for a request was held until its first token while its sequence was already
    counted in flight: with room for two, one request being prefilled turned the second away (503)."""
    engine = make_engine(**SMALL, max_num_seqs=1, max_waiting=1)
    # Steps wait at a gate, so the first request is still before its first token when the second comes.
    gate = gate_steps(engine, monkeypatch)
    async_engine = AsyncEngine(engine)
    body = {"prompt": "Hi", "max_tokens": 2}
    with serve_app(create_app(async_engine, ServerOptions())) as url, ThreadPoolExecutor(2) as pool:

        def post() -> httpx.Response:
            return httpx.post(f"{url}/v1/completions", json=body, timeout=120)

        def wait_in_flight(count: int, pending: "Future[httpx.Response]") -> None:
            deadline = time.monotonic() + 60
            while async_engine.num_in_flight < count:
                assert not pending.done(), pending.result().text
                assert time.monotonic() < deadline
                time.sleep(0.01)

        try:
            first = pool.submit(post)
            wait_in_flight(1, first)
            second = pool.submit(post)
            wait_in_flight(2, second)
        finally:
            gate.set()
        assert first.result().status_code == 200
        assert second.result().status_code == 200, second.result().text


def test_sigterm_lets_the_stream_in_flight_finish_then_exits() -> None:
    port = free_port()
    argv = [sys.executable, "-m", "kvserve", "serve", "--port", str(port), "--kv-cache-memory", "32MiB"]
    # The grace is far above what 40 tokens need on a loaded machine: the test is about the order of
    # events, not about the machine's speed.
    argv += ["--max-model-len", "512", "--shutdown-grace", "600"]
    with server_process(argv, port) as (process, url):
        body = {
            "prompt": "Once upon a time",
            "max_tokens": 40,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        events: list[str] = []
        refused = False
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 1:
                    process.send_signal(signal.SIGTERM)
                elif not refused:
                    # New connections are refused once the server has begun to shut down.
                    try:
                        httpx.get(f"{url}/health", timeout=5)
                    except httpx.TransportError:
                        refused = True
        assert refused
        # The stream in flight ran to its end.
        assert events[-1] == "data: [DONE]"
        usage = json.loads(events[-2].removeprefix("data: "))["usage"]
        assert usage["completion_tokens"] == 40
        assert json.loads(events[-3].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
        output = process.communicate(timeout=60)[0].decode()
        # uvicorn re-raises the signal once it has shut down, so the exit status says SIGTERM.
        assert process.returncode in (0, -signal.SIGTERM), output
        assert "Traceback" not in output
        assert "completion tokens, finish length" in output  # the per-request log line
        # Without keys, the server says that every client shares one cache namespace.
        assert "tenancy: single-tenant" in output


def test_the_shutdown_grace_is_the_servers_option() -> None:
    """--shutdown-grace reaches the server: with none, the stream in flight at SIGTERM is cut at once
    rather than finished (400 tokens cannot come before the server's first shutdown tick)."""
    port = free_port()
    argv = [sys.executable, "-m", "kvserve", "serve", "--port", str(port), "--kv-cache-memory", "32MiB"]
    argv += ["--max-model-len", "512", "--shutdown-grace", "0"]
    with server_process(argv, port) as (process, url):
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
        events: list[str] = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            try:
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                    if len(events) == 1:
                        process.send_signal(signal.SIGTERM)
            except httpx.RemoteProtocolError:
                pass
        output = process.communicate(timeout=60)[0].decode()
    assert events and events[-1] != "data: [DONE]"
    assert "timeout graceful shutdown exceeded" in output
