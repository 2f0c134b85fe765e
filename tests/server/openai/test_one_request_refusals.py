"""Limits on one request: each refusal is a clear OpenAI-shaped 4xx before any work starts, and the
server stays healthy with nothing held: body size, stop strings and ids, messages, max_tokens, prompts
over the context (refused before the chat template renders), templating off the event loop, and
requests in flight per tenant."""

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.engine.reply_memory import ReplyMemory, entry_bytes
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from kvserve.server.core.messages import MAX_MESSAGES, MAX_STOP_CHARS
from kvserve.server.http.tenants import Tenants, load_or_create_secret
from kvserve.server.openai.protocol import MAX_STOP_TOKEN_IDS

MAX_MODEL_LEN = 512
MAX_REQUEST_BYTES = 64 * 2**10
IN_FLIGHT = 2
KEYS = {"a": "key-aaaaaaaa", "b": "key-bbbbbbbb"}


@dataclass
class LimitServer:
    url: str
    async_engine: AsyncEngine

    def post(self, path: str, body: Any, tenant: str = "a", **kwargs: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {KEYS[tenant]}", **kwargs.pop("headers", {})}
        return httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=120, **kwargs)

    def assert_idle_and_healthy(self) -> None:
        deadline = time.monotonic() + 60
        while True:
            stats = asyncio.run(self.async_engine.stats())
            idle = stats.num_running == stats.num_waiting == stats.cache.num_locked == 0
            if idle and self.async_engine.num_in_flight == 0:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.05)
        assert stats.cache.num_free + stats.cache.num_cached == stats.cache.num_blocks
        assert httpx.get(f"{self.url}/health", timeout=30).status_code == 200
        ok = self.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory,
    make_engine: Callable[..., Engine],
    serve_app: Callable[[FastAPI], AbstractContextManager[str]],
) -> Iterator[LimitServer]:
    folder = tmp_path_factory.mktemp("limits")
    (folder / "keys").write_text("".join(f"{t}:{k}\n" for t, k in KEYS.items()))
    tenants = Tenants(load_or_create_secret(str(folder)), key_file=str(folder / "keys"))
    async_engine = AsyncEngine(make_engine(kv_cache_memory=32 * 2**20, max_model_len=MAX_MODEL_LEN))
    app = create_app(
        async_engine,
        ServerOptions(max_request_bytes=MAX_REQUEST_BYTES, max_in_flight_per_tenant=IN_FLIGHT),
        tenants,
    )
    with serve_app(app) as url:
        yield LimitServer(url, async_engine)


def test_a_body_over_the_limit_gets_413(server: LimitServer) -> None:
    big = {"prompt": "x" * MAX_REQUEST_BYTES, "max_tokens": 1}
    assert_error(server.post("/v1/completions", big), 413, code="request_too_large")

    def chunks() -> Iterator[bytes]:
        # No Content-Length: the limit holds on the bytes that arrive.
        yield b'{"prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 1024 + 1):
            yield b"y" * 1024
        yield b'", "max_tokens": 1}'

    headers = {"Authorization": f"Bearer {KEYS['a']}", "Content-Type": "application/json"}
    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers=headers, timeout=60)
    assert_error(r, 413, code="request_too_large")
    # Just under the limit the body is read and judged on its merits.
    assert server.post("/v1/completions", {"prompt": "z" * 1000, "max_tokens": 1}).status_code == 200
    server.assert_idle_and_healthy()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "Hi", "stop": [f"s{i}" for i in range(17)]}, "stop"),
        ({"prompt": "Hi", "stop": "s" * (MAX_STOP_CHARS + 1)}, "stop"),
        ({"prompt": "Hi", "stop": ["ok", "s" * (MAX_STOP_CHARS + 1)]}, "stop"),
        ({"prompt": "Hi", "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
        ({"prompt": "Hi", "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"prompt": "Hi", "max_tokens": -5}, "max_tokens"),
        ({"prompt": "Hi", "max_tokens": 10**30}, "max_tokens"),
        ({"prompt": "Hi", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "Hi", "cache_salt": ""}, "cache_salt"),
        ({"prompt": "Hi", "cache_salt": "s" * 257}, "cache_salt"),
        ({"prompt": "x" * (MAX_MODEL_LEN * 100)}, "prompt"),
        ({"prompt": list(range(MAX_MODEL_LEN + 1))}, "prompt"),
    ],
)
def test_completion_fields_out_of_bounds_get_400(server: LimitServer, body: Any, param: str) -> None:
    assert_error(server.post("/v1/completions", body), 400, param=param)


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ([{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1), "messages"),
        ([{"role": "function", "content": "hi"}], "messages.0.role"),
        ([{"role": "user"}], "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
            "messages[0].content[0]",
        ),
    ],
)
def test_bad_messages_get_400(server: LimitServer, messages: Any, param: str) -> None:
    r = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert_error(r, 400, param=param)


def test_a_prompt_over_the_context_is_refused_before_rendering(
    server: LimitServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = server.async_engine.tokenizer
    calls: list[str] = []
    render, encode = tokenizer.render_chat, tokenizer.encode
    monkeypatch.setattr(tokenizer, "render_chat", lambda *a, **k: calls.append("render") or render(*a, **k))  # type: ignore[func-returns-value]
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: calls.append("encode") or encode(*a, **k))  # type: ignore[func-returns-value]
    # Within the body limit, but more characters than MAX_MODEL_LEN of the longest tokens could hold.
    huge = "word " * 12_000
    messages = [{"role": "user", "content": huge}]
    r = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert_error(r, 400, param="messages")
    assert "maximum context length" in r.json()["error"]["message"]
    r = server.post("/tokenize", {"prompt": huge})
    assert_error(r, 400, param="prompt")
    assert calls == []
    # A prompt that may fit is rendered and tokenized, then judged by its tokens.
    r = server.post(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    )
    assert r.status_code == 200 and calls == ["render", "encode"]
    server.assert_idle_and_healthy()


@pytest.mark.parametrize("where", ["tool description", "call arguments", "tool result"])
def test_tool_text_over_the_context_is_refused_before_rendering(
    server: LimitServer, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    tokenizer = server.async_engine.tokenizer
    calls: list[str] = []
    render, encode = tokenizer.render_chat, tokenizer.encode
    monkeypatch.setattr(tokenizer, "render_chat", lambda *a, **k: calls.append("render") or render(*a, **k))  # type: ignore[func-returns-value]
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **k: calls.append("encode") or encode(*a, **k))  # type: ignore[func-returns-value]
    huge = "word " * 12_000
    description = huge if where == "tool description" else "The weather in a city."
    arguments = json.dumps({"city": huge if where == "call arguments" else "Paris"})
    result = huge if where == "tool result" else "sunny"
    tools = [{"type": "function", "function": {"name": "get_weather", "description": description}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": result},
    ]
    r = server.post("/v1/chat/completions", {"messages": messages, "tools": tools, "max_tokens": 1})
    assert_error(r, 400, param="tools" if where == "tool description" else "messages")
    assert "maximum context length" in r.json()["error"]["message"]
    assert calls == []
    server.assert_idle_and_healthy()


@pytest.mark.parametrize(
    "extra",
    [
        {"structured_outputs": {"x" * 50_000: 1}},
        {"response_format": {"type": "y" * 50_000}},
        {"messages": [{"role": "user", "content": [{"type": "z" * 50_000}]}]},
        {"logit_bias": {"w" * 50_000: 1}},
    ],
)
def test_an_error_quotes_a_huge_name_only_in_part(server: LimitServer, extra: dict[str, Any]) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **extra}
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert len(error["message"]) <= 1003 and len(error["param"] or "") <= 1003, len(r.content)
    server.assert_idle_and_healthy()


def test_templating_runs_off_the_event_loop(server: LimitServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """While one request's chat template renders (held here until /health has answered), the event
    loop serves others: were rendering on the loop, /health could not answer and this test would fail
    on its timeout."""
    tokenizer = server.async_engine.tokenizer
    rendering, health_answered = threading.Event(), threading.Event()
    render = tokenizer.render_chat

    def slow_render(*args: Any, **kwargs: Any) -> str:
        rendering.set()
        health_answered.wait(60)
        return render(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "render_chat", slow_render)
    result: list[httpx.Response] = []
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    chat = threading.Thread(target=lambda: result.append(server.post("/v1/chat/completions", body)))
    chat.start()
    try:
        assert rendering.wait(60)
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    finally:
        health_answered.set()
        chat.join(60)
    assert result[0].status_code == 200


def test_requests_in_flight_are_limited_per_tenant(server: LimitServer) -> None:
    body = {"prompt": "Count to a thousand:", "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            a = {"Authorization": f"Bearer {KEYS['a']}"}

            async def hold() -> None:
                async with client.stream("POST", "/v1/completions", json=body, headers=a) as r:
                    async for _ in r.aiter_lines():
                        pass

            holders = [asyncio.create_task(hold()) for _ in range(IN_FLIGHT)]
            deadline = time.monotonic() + 60
            while server.async_engine.num_in_flight < IN_FLIGHT:
                assert time.monotonic() < deadline and not any(h.done() for h in holders)
                await asyncio.sleep(0.02)
            refused = await client.post("/v1/completions", json={**body, "stream": False}, headers=a)
            other = await client.post(
                "/v1/completions",
                json={"prompt": "Hi", "max_tokens": 2},
                headers={"Authorization": f"Bearer {KEYS['b']}"},
            )
            for h in holders:
                h.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            return refused, other

    refused, other = asyncio.run(scenario())
    assert_error(refused, 429, code="rate_limit_exceeded")
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    # Another tenant is not held back by a's requests.
    assert other.status_code == 200, other.text
    # Slots come back when the streams end, however they end.
    server.assert_idle_and_healthy()


def test_reply_memory_is_bounded_in_bytes() -> None:
    one = entry_bytes("ns", "reply 0", [1, 2, 3])
    memory = ReplyMemory(capacity_bytes=3 * one)
    for i in range(10):
        memory.remember("ns", f"reply {i}", [1, 2, 3])
    assert len(memory) == 3 and memory.num_bytes <= memory.capacity_bytes
    assert memory.lookup("ns", "reply 9") == [1, 2, 3] and memory.lookup("ns", "reply 0") is None
    # One long reply takes the room of many short ones; one larger than the whole memory is not kept.
    memory.remember("ns", "long " * 10, list(range(20)))
    assert memory.lookup("ns", "reply 7") is None and memory.num_bytes <= memory.capacity_bytes
    memory.remember("ns", "x" * memory.capacity_bytes, [1])
    assert memory.lookup("ns", "x" * memory.capacity_bytes) is None


def test_a_wrong_key_file_stops_the_server_before_it_loads(tmp_path: Path) -> None:
    from kvserve.cli import main

    (tmp_path / "keys").write_text("a:key-aaaaaaaa\nb:key-aaaaaaaa\n")
    assert main(["serve", "--api-key-file", str(tmp_path / "keys")]) == 2
