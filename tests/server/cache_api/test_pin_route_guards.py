"""The pin route passes the guards every request passes: pinning must be on before any work, the
prompt-length guard runs before tokenizing, tokenizing runs off the event loop, token ids are checked
against the vocabulary before the engine sees them, and a pin holds one of its tenant's in-flight
slots."""

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.model.loader import LoadedModel
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from kvserve.server.http.tenants import DEFAULT_TENANT
from tests.harness import engine_with_blocks

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4
PREFIX = [100 + (i * 7) % 3000 for i in range(16)]


@dataclass
class PinServer:
    url: str
    async_engine: AsyncEngine
    app: FastAPI

    def pin(self, body: Any, timeout: float = 60) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/cache/pin", json=body, timeout=timeout)

    def in_flight(self) -> int:
        return int(self.app.state.context.in_flight.in_flight(DEFAULT_TENANT))


@pytest.fixture(scope="module")
def pinning_off(
    tiny_model: LoadedModel, serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[PinServer]:
    async_engine = AsyncEngine(engine_with_blocks(tiny_model, 64, BLOCK))
    app = create_app(async_engine, ServerOptions())
    with serve_app(app) as url:
        yield PinServer(url, async_engine, app)


@pytest.fixture(scope="module")
def pinning_on(
    tiny_model: LoadedModel, serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[PinServer]:
    async_engine = AsyncEngine(engine_with_blocks(tiny_model, 64, BLOCK, max_pinned_tokens=16 * BLOCK))
    # One request in flight per tenant, so that a pin's slot shows.
    app = create_app(async_engine, ServerOptions(max_in_flight_per_tenant=1))
    with serve_app(app) as url:
        yield PinServer(url, async_engine, app)


def tokenizer_calls(server: PinServer, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    tokenizer = server.async_engine.tokenizer
    calls: list[str] = []
    encode, render = tokenizer.encode, tokenizer.render_chat
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: calls.append("encode") or encode(*a, **k))  # type: ignore[func-returns-value]
    monkeypatch.setattr(tokenizer, "render_chat", lambda *a, **k: calls.append("render") or render(*a, **k))  # type: ignore[func-returns-value]
    return calls


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error


def test_a_pin_on_a_server_with_pinning_off_is_refused_before_tokenizing(
    pinning_off: PinServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 7 of the hardening review: a 7 MB text pin was tokenized on the event loop (3.4 s of a
    frozen /health) before the engine said that pinning is off."""
    calls = tokenizer_calls(pinning_off, monkeypatch)
    for body in (
        {"prompt": "word " * 200_000, "ttl_s": 60},
        {"messages": [{"role": "user", "content": "Hi"}], "ttl_s": 60},
        {"prompt": PREFIX, "ttl_s": 60},
        {"prompt": [2**64] * 8, "ttl_s": 60},
    ):
        r = pinning_off.pin(body)
        assert_error(r, 400, code="pinning_disabled")
        assert "--max-pinned-tokens" in r.json()["error"]["message"]
    assert calls == []
    assert httpx.get(f"{pinning_off.url}/health", timeout=30).status_code == 200


def test_a_pin_over_the_context_is_refused_before_tokenizing(
    pinning_on: PinServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = tokenizer_calls(pinning_on, monkeypatch)
    r = pinning_on.pin({"prompt": "word " * 200_000, "ttl_s": 60})
    assert_error(r, 400, param="prompt")
    assert "maximum context length" in r.json()["error"]["message"]
    r = pinning_on.pin({"messages": [{"role": "user", "content": "word " * 200_000}], "ttl_s": 60})
    assert_error(r, 400, param="messages")
    assert calls == []


def test_pin_token_ids_outside_the_vocabulary_are_refused_before_the_engine(
    pinning_on: PinServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 3's door: ids the engine cannot embed (2**64 broke the disk tier's key packing after
    blocks were locked) get a clear 400 and never reach the engine."""
    engine = pinning_on.async_engine.engine
    pinned: list[int] = []
    pin = engine.pin
    monkeypatch.setattr(
        engine,
        "pin",
        lambda ns, tokens, ttl: pinned.append(len(tokens)) or pin(ns, tokens, ttl),  # type: ignore[func-returns-value]
    )
    vocab = engine.model.config.vocab_size
    for bad in ([2**64] * 8, [-1] * 8, [*PREFIX, vocab], [10**30]):
        r = pinning_on.pin({"prompt": bad, "ttl_s": 60})
        assert_error(r, 400, param="prompt")
        assert f"[0, {vocab})" in r.json()["error"]["message"]
    assert pinned == []
    # Ids within the vocabulary are pinned as before.
    ok = pinning_on.pin({"prompt": PREFIX, "ttl_s": 60})
    assert ok.status_code == 200 and ok.json()["pinned_tokens"] == len(PREFIX), ok.text
    assert httpx.delete(f"{pinning_on.url}/v1/cache/pin/{ok.json()['id']}", timeout=30).status_code == 200


def test_a_pin_tokenizes_off_the_event_loop(pinning_on: PinServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a pin's text is tokenized (held here until /health has answered), the event loop serves
    others: were tokenizing on the loop, /health could not answer and would time out."""
    tokenizer = pinning_on.async_engine.tokenizer
    encoding, health_answered = threading.Event(), threading.Event()
    encode = tokenizer.encode

    def slow_encode(*args: Any, **kwargs: Any) -> list[int]:
        encoding.set()
        health_answered.wait(60)
        return encode(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    result: list[httpx.Response] = []
    body = {"prompt": "Hi there", "ttl_s": 60}
    pin = threading.Thread(target=lambda: result.append(pinning_on.pin(body)))
    pin.start()
    try:
        assert encoding.wait(60)
        assert httpx.get(f"{pinning_on.url}/health", timeout=20).status_code == 200
    finally:
        health_answered.set()
        pin.join(60)
    # Two tokens are shorter than a block: refused, but only after tokenizing.
    assert_error(result[0], 400)


def test_a_pin_holds_an_in_flight_slot(pinning_on: PinServer) -> None:
    """A pin in flight counts against its tenant's limit (1 here), and is refused when the tenant has
    no slot left."""
    holding, release = threading.Event(), threading.Event()

    def hold(engine: Engine) -> None:
        holding.set()
        release.wait(60)

    async def scenario() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=pinning_on.url, timeout=60) as client:
            held = asyncio.ensure_future(pinning_on.async_engine.call(hold))
            while not holding.is_set():
                await asyncio.sleep(0.01)
            # The engine thread is held: the pin waits on it, in flight.
            pin = asyncio.ensure_future(client.post("/v1/cache/pin", json={"prompt": PREFIX, "ttl_s": 60}))
            deadline = asyncio.get_running_loop().time() + 60
            while pinning_on.in_flight() < 1:
                assert asyncio.get_running_loop().time() < deadline and not pin.done()
                await asyncio.sleep(0.01)
            beside = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
            second_pin = await client.post("/v1/cache/pin", json={"prompt": PREFIX, "ttl_s": 60})
            release.set()
            await held
            return await pin, beside, second_pin

    try:
        pinned, beside, second_pin = asyncio.run(scenario())
    finally:
        release.set()
    assert pinned.status_code == 200, pinned.text
    assert_error(beside, 429, code="rate_limit_exceeded")
    assert_error(second_pin, 429, code="rate_limit_exceeded")
    # The slot is let go once the response has been sent, which can be just after the client has it.
    deadline = time.monotonic() + 10
    while pinning_on.in_flight() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pinning_on.in_flight() == 0
    assert httpx.delete(f"{pinning_on.url}/v1/cache/pin/{pinned.json()['id']}", timeout=30).status_code == 200
