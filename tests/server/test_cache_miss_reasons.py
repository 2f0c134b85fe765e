"""Every miss reason produced on purpose over HTTP, through the official SDKs, on the tiny model.

A changed system prompt byte (diverged in `system`, at the first differing token), a reordered tool list
(`tools`), a tool call's arguments re-spaced (`message 2`), an eviction flood (`evicted`), a retention
that expired before a flood (`expired`), a Redis tier paused past the load budget (`load_timeout`) and
stopped (`tier_unavailable`); another tenant's
identical prompt reads exactly as a never-seen one. Chat reports in its header and, when asked, in its
usage; Messages answers Anthropic's `diagnostics`, Responses OpenAI's `prompt_cache_diagnostics`.
"""

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import pytest
from fastapi import FastAPI

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from kvserve.server.core.cache_report import CACHE_HEADER
from kvserve.server.http.tenants import Tenants, load_or_create_secret
from tests.redis_server import RedisServer

KEYS = {"a": "key-aaaaaaaa", "b": "key-bbbbbbbb", "c": "key-cccccccc", "d": "key-dddddddd"}
ADMIN_KEY = "admin-key-0000"
KEY_FILE = "".join(f"{t}:{k}\n" for t, k in KEYS.items())
NAME = "m"
# 64 blocks of 16 tokens: a flood of ten 200-token prompts cycles the pool.
POOL_BYTES = 2**18
SYSTEM = "You are a careful assistant for a shipping company; answer in one short sentence. " * 3
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"Look up the {name.split('_')[1]} of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    for name in ("get_weather", "get_time")
]


@dataclass
class Live:
    url: str
    async_engine: AsyncEngine

    # The clients loosely typed: the tests send dicts the SDKs' TypedDicts describe.
    def openai(self, tenant: str = "a") -> Any:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=120)

    def anthropic(self, tenant: str = "a") -> Any:
        return anthropic.Anthropic(base_url=self.url, api_key=KEYS[tenant], max_retries=0, timeout=120)

    def tokens(self, messages: list[dict[str, Any]], tenant: str = "a") -> list[int]:
        r = httpx.post(
            f"{self.url}/tokenize",
            json={"messages": messages},
            headers={"Authorization": f"Bearer {KEYS[tenant]}"},
        )
        assert r.status_code == 200, r.text
        ids: list[int] = r.json()["tokens"]
        return ids

    def stats(self, tenant: str) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/v1/cache/stats", headers={"Authorization": f"Bearer {KEYS[tenant]}"})
        assert r.status_code == 200, r.text
        stats: dict[str, Any] = r.json()
        return stats

    def flood(self, tenant: str = "b", prompts: int = 10) -> None:
        """Unique prompts that cycle the pool (another tenant's: the pool is shared)."""
        client = self.openai(tenant)
        for i in range(prompts):
            words = " ".join(f"w{i}x{j}" for j in range(60))
            client.completions.create(model=NAME, prompt=words, max_tokens=1, temperature=0)


def _tenants(tmp_path_factory: pytest.TempPathFactory) -> Tenants:
    folder = tmp_path_factory.mktemp("miss-tenants")
    (folder / "keys").write_text(KEY_FILE)
    return Tenants(load_or_create_secret(str(folder)), key_file=str(folder / "keys"))


@pytest.fixture(scope="module")
def live(
    tmp_path_factory: pytest.TempPathFactory,
    make_tiny_engine: Callable[..., Engine],
    serve_app: Callable[[FastAPI], AbstractContextManager[str]],
) -> Iterator[Live]:
    engine = make_tiny_engine(kv_cache_memory=POOL_BYTES, block_size=16, max_model_len=512)
    async_engine = AsyncEngine(engine)
    app = create_app(
        async_engine, ServerOptions(served_model_name=NAME, admin_key=ADMIN_KEY), _tenants(tmp_path_factory)
    )
    with serve_app(app) as url:
        yield Live(url, async_engine)


def _header(raw: Any) -> dict[str, str]:
    value: str = raw.headers[CACHE_HEADER]
    return dict(field.split("=", 1) for field in value.split("; "))


def _chat(client: Any, messages: list[dict[str, Any]], **extra: Any) -> Any:
    return client.chat.completions.with_raw_response.create(
        model=NAME, messages=messages, max_tokens=1, temperature=0, **extra
    )


def _first_difference(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


def test_a_changed_system_byte_is_diverged_in_system_at_its_token(live: Live) -> None:
    client = live.openai()
    ask = {"role": "user", "content": "Where is my parcel?"}
    before = [{"role": "system", "content": SYSTEM}, ask]
    after = [{"role": "system", "content": SYSTEM[:12] + "X" + SYSTEM[13:]}, ask]
    first = _chat(client, before)
    assert _header(first)["reason"] == "none"
    # Off by default: OpenAI's usage, nothing new.
    assert "kvserve_cache_report" not in first.parse().usage.model_dump()
    second = _chat(client, after, extra_body={"kvserve_cache_report": True})
    position = _first_difference(live.tokens(before), live.tokens(after))
    report = second.parse().usage.model_extra["kvserve_cache_report"]
    assert report["reason"] == "diverged" and report["part"] == "system"
    assert report["position"] == position and report["missed_tokens"] > 0
    assert _header(second) == {
        "cached": str(report["cached_tokens"]),
        "missed": str(report["missed_tokens"]),
        "reason": "diverged",
        "position": str(position),
        "part": "system",
    }
    # The dashboard's "why it missed": the caller's own namespace, no text unless the server shows it.
    (last, *_) = live.stats("a")["misses"]
    assert (last["reason"], last["part"], last["position"]) == ("diverged", "system", position)
    assert last["before"] is None and last["after"] is None
    assert not any(m["reason"] == "diverged" for m in live.stats("c")["misses"])


def test_a_reordered_tool_list_is_tools_changed_in_anthropics_diagnostics(live: Live) -> None:
    client = live.anthropic()
    tools = [
        {"name": t["function"]["name"], "description": t["function"]["description"]}
        | {"input_schema": t["function"]["parameters"]}
        for t in TOOLS
    ]
    ask: dict[str, Any] = {
        "model": NAME,
        "max_tokens": 1,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": "What time is it in Oslo?"}],
    }
    first = client.messages.create(**ask, tools=tools, diagnostics={"previous_message_id": None})
    assert first.diagnostics is not None and first.diagnostics.cache_miss_reason is None
    raw = client.messages.with_raw_response.create(
        **ask, tools=tools[::-1], diagnostics={"previous_message_id": first.id}
    )
    second = raw.parse()
    reason = second.diagnostics.cache_miss_reason
    assert reason.type == "tools_changed" and reason.cache_missed_input_tokens > 0
    assert _header(raw)["part"] == "tools"
    assert second.usage.cache_creation is not None
    # Without `diagnostics`, the message has none.
    assert client.messages.create(**ask, tools=tools[::-1]).diagnostics is None


def test_re_spaced_tool_call_arguments_are_diverged_in_that_message(live: Live) -> None:
    client = live.openai()

    def conversation(arguments: str) -> list[dict[str, Any]]:
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": arguments},
        }
        return [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees."},
        ]

    _chat(client, conversation('{"city": "Paris"}'), tools=TOOLS)
    # Streamed: the header goes out with the status line, the report in the usage chunk.
    with client.chat.completions.with_streaming_response.create(
        model=NAME,
        messages=conversation('{"city":"Paris"}'),
        tools=TOOLS,
        max_tokens=1,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"kvserve_cache_report": True},
    ) as raw:
        figures = _header(raw)
        chunks = list(raw.parse())
    assert figures["reason"] == "diverged" and figures["part"] == "message-2", figures
    report = chunks[-1].usage.model_extra["kvserve_cache_report"]
    assert (report["reason"], report["part"]) == ("diverged", "message 2")


def test_an_eviction_flood_is_evicted_and_counted(live: Live) -> None:
    client = live.openai()
    prompt = "Tracking numbers and their routes, " + " ".join(f"r{j}" for j in range(80))
    client.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0)
    live.flood()
    raw = client.completions.with_raw_response.create(
        model=NAME, prompt=prompt, max_tokens=1, temperature=0, extra_body={"kvserve_cache_report": True}
    )
    report = raw.parse().usage.model_extra["kvserve_cache_report"]
    assert report["reason"] == "evicted" and report["missed_tokens"] >= 16, report
    metrics = httpx.get(f"{live.url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
    assert any(
        line.startswith('kvserve_cache_misses_total{model_name="m",reason="evicted"}')
        and float(line.split()[-1]) >= 1
        for line in metrics.splitlines()
    ), metrics


def test_a_retention_that_expired_before_a_flood_is_expired(live: Live) -> None:
    client = live.openai()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Kept for a day?"}]
    _chat(client, messages, extra_body={"prompt_cache_retention": "24h"})
    kv = live.async_engine.engine.kv
    # The retention's hour is over: the engine's clock jumps ahead (its next step expires it).
    kv.clock = lambda: time.monotonic() + 7200
    try:
        live.flood()
        raw = _chat(client, messages)
    finally:
        kv.clock = time.monotonic
    assert _header(raw)["reason"] == "expired", _header(raw)


def test_another_tenants_identical_prompt_reads_as_never_seen(live: Live) -> None:
    """Tenants c and d have sent nothing: c sends what a sent twice, d a prompt nobody sent."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is this shared?"}]
    _chat(live.openai("a"), messages)
    assert _header(_chat(live.openai("a"), messages))["cached"] != "0"
    theirs = _chat(live.openai("c"), messages)
    never = _chat(live.openai("d"), [{"role": "system", "content": SYSTEM[::-1]}, messages[1]])
    assert _header(theirs) == _header(never) == {"cached": "0", "missed": "0", "reason": "none"}
    # A's message id names nothing for c: not found, as an id never answered.
    ask: dict[str, Any] = {"model": NAME, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    a_id = live.anthropic("a").messages.create(**ask).id
    for previous in (a_id, "msg_never_answered"):
        got = live.anthropic("c").messages.create(**ask, diagnostics={"previous_message_id": previous})
        assert got.diagnostics.cache_miss_reason.type == "previous_message_not_found"


def test_responses_name_a_changed_instruction_input_changed(live: Live) -> None:
    client = live.openai()
    first = client.responses.create(
        model=NAME, instructions=SYSTEM, input="Refund policy?", max_output_tokens=1
    )
    second = client.responses.create(
        model=NAME,
        instructions="Today is Tuesday. " + SYSTEM,
        input="Refund policy?",
        max_output_tokens=1,
        prompt_cache_options={"comparison_response_id": first.id},
    )
    diagnostics = second.prompt_cache_diagnostics
    assert diagnostics.type == "cache_miss" and diagnostics.reason == "input_changed"
    assert diagnostics.cache_missed_tokens > 0


def test_a_paused_redis_is_load_timeout_and_a_stopped_one_tier_unavailable(
    make_tiny_engine: Callable[..., Engine], serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> None:
    """Two prompts written to Redis, then evicted from memory by a flood: one asked for while Redis is
    paused past the load budget (load_timeout), the other once Redis is stopped (tier_unavailable)."""
    redis = RedisServer()
    redis.start()
    try:
        engine = make_tiny_engine(
            kv_cache_memory=POOL_BYTES,
            block_size=16,
            max_model_len=512,
            kv_remote=redis.url,
            secret=b"s" * 32,
        )
        async_engine = AsyncEngine(engine)
        options = ServerOptions(served_model_name=NAME, dashboard_show_text=True)
        with serve_app(create_app(async_engine, options)) as url:
            client: Any = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

            def complete(prompt: str) -> dict[str, str]:
                raw = client.completions.with_raw_response.create(
                    model=NAME, prompt=prompt, max_tokens=1, temperature=0
                )
                return _header(raw)

            stopped = "Parcels held at the depot, " + " ".join(f"d{j}" for j in range(80))
            paused = "Parcels late at customs, " + " ".join(f"c{j}" for j in range(80))
            complete(stopped)
            complete(paused)
            admin = redis.client()
            deadline = time.monotonic() + 30
            while admin.dbsize() < 8 and time.monotonic() < deadline:
                time.sleep(0.05)
            for i in range(10):
                complete(" ".join(f"z{i}x{j}" for j in range(60)))
            engine.kv.tiers.set_budget(0.05)
            admin.client_pause(5000)
            assert complete(paused)["reason"] == "load_timeout"
            admin.close()
            redis.stop()
            assert complete(stopped)["reason"] == "tier_unavailable"
            # With --dashboard-show-text, the text on each side of where the miss starts.
            (last, *_) = httpx.get(f"{url}/v1/cache/stats").json()["misses"]
            assert last["reason"] == "tier_unavailable" and last["after"], last
    finally:
        redis.stop()
