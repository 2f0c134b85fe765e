"""cache_control through Anthropic's Messages API: a breakpoint's prefix is held against eviction.

A message whose system block carries cache_control keeps that prefix through a flood of other prompts
that cycles the whole pool, so its next turn reads it from the cache; the same message without the
breakpoint loses it to the same flood (which shows the flood evicts, so the test can fail).
"""

import random
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import anthropic
import httpx
import pytest
from fastapi import FastAPI

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from tests.server.live import Server

NAME = "m"
# About 700 tokens of float16 KV for the default model: five 400-token prompts cycle it.
POOL_BYTES = 16 * 2**20
FLOOD_PROMPTS = 5
FLOOD_TOKENS = 400


@pytest.fixture
def server(
    make_engine: Callable[..., Engine], serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[Server]:
    async_engine = AsyncEngine(make_engine(kv_cache_memory=POOL_BYTES, max_model_len=512))
    with serve_app(create_app(async_engine, ServerOptions(served_model_name=NAME))) as url:
        yield Server(url, async_engine)


def _flood(url: str, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(FLOOD_PROMPTS):
        prompt = rng.choices(range(1000, 40000), k=FLOOD_TOKENS)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=300)
        assert r.status_code == 200, r.text


def _turn(client: anthropic.Anthropic, system: Any, question: str, stream: bool) -> Any:
    args: dict[str, Any] = {
        "model": NAME,
        "max_tokens": 2,
        "system": system,
        "messages": [{"role": "user", "content": question}],
        "extra_body": {"temperature": 0},
    }
    if stream:
        with client.messages.stream(**args) as events:
            return events.get_final_message().usage
    return client.messages.create(**args).usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("breakpoint", [True, False])
def test_a_breakpoints_prefix_survives_a_flood_that_cycles_the_pool(
    server: Server, breakpoint: bool, stream: bool
) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    text = "You are a careful assistant for a shipping company; answer in one short sentence. " * 5
    block: dict[str, Any] = {"type": "text", "text": text}
    if breakpoint:
        block["cache_control"] = {"type": "ephemeral"}
    first = _turn(client, [block], "Where is my parcel?", stream)
    assert first.cache_read_input_tokens == 0
    if breakpoint:
        assert first.cache_creation_input_tokens > 64
    _flood(server.url, seed=1)
    second = _turn(client, [block], "When does it arrive?", stream)
    if breakpoint:
        # The system block's whole blocks, at least, come from the cache.
        assert second.cache_read_input_tokens >= first.cache_creation_input_tokens - 16
    else:
        assert second.cache_read_input_tokens == 0
