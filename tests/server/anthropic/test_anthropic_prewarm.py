"""A pre-warm through Anthropic's Messages API: `max_tokens: 0` computes the prompt and keeps it.

The answer is a message with no content, stop_reason `max_tokens` and the usage of the write; the same
prompt after it reads all the pre-warm computed, and no write is reported twice. Its
breakpoints are retained as a normal request's are (a flood that cycles the pool leaves the prefix),
and it counts in its tenant's figures like any request.
"""

import random
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import anthropic
import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from tests.server.live import Server, assert_no_leak

NAME = "m"
BLOCK = 16
# About 700 tokens of float16 KV for the default model: five 400-token prompts cycle it.
POOL_BYTES = 16 * 2**20
SYSTEM = "You are a careful assistant for a shipping company; answer in one short sentence. " * 5


@pytest.fixture
def server(
    make_engine: Callable[..., Engine], serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[Server]:
    engine = make_engine(kv_cache_memory=POOL_BYTES, max_model_len=512, block_size=BLOCK)
    async_engine = AsyncEngine(engine)
    with serve_app(create_app(async_engine, ServerOptions(served_model_name=NAME))) as url:
        yield Server(url, async_engine)


def _client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def _message(client: anthropic.Anthropic, stream: bool, **args: Any) -> Any:
    args = {"model": NAME, "extra_body": {"temperature": 0}, **args}
    if stream:
        with client.messages.stream(**args) as events:
            kinds = [event.type for event in events]
            message = events.get_final_message()
        if args["max_tokens"] == 0:
            # No content block between the start and the end.
            assert not any(k.startswith("content_block") for k in kinds), kinds
        return message
    return client.messages.create(**args)


def _prompt(usage: Any) -> int:
    return int(usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_prewarm_writes_the_prompt_and_the_same_prompt_reads_it(server: Server, stream: bool) -> None:
    client = _client(server)
    ask = {"system": SYSTEM, "messages": [{"role": "user", "content": "Where is my parcel?"}]}
    # The top-level breakpoint keeps the whole conversation, as automatic caching does.
    top = {"cache_control": {"type": "ephemeral"}}
    warm = _message(client, stream, max_tokens=0, **ask, **top)
    assert warm.content == [] and warm.stop_reason == "max_tokens" and warm.stop_sequence is None
    usage = warm.usage
    assert usage.output_tokens == 0 and usage.cache_read_input_tokens == 0
    prompt = _prompt(usage)
    assert usage.cache_creation_input_tokens > 64
    assert usage.cache_creation_input_tokens % BLOCK == 0
    assert_no_leak(server.wait_idle())

    again = _message(client, stream, max_tokens=2, **ask, **top).usage
    assert _prompt(again) == prompt
    # The whole prompt the pre-warm computed is read, its partial last block included, but the last
    # token (a request computes one at least); the write is reported once: by the pre-warm.
    assert again.cache_read_input_tokens == prompt - 1
    assert again.cache_creation_input_tokens == 0
    assert_no_leak(server.wait_idle())


def _flood(url: str, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(5):
        prompt = rng.choices(range(1000, 40000), k=400)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=300)
        assert r.status_code == 200, r.text


# Streamed pre-warms write as whole ones do (the test above); the flood, the slow part, runs once with a
# breakpoint and once without, the control that shows the flood evicts.
@pytest.mark.parametrize("breakpoint", [True, False], ids=["retained", "none"])
def test_a_prewarms_breakpoint_survives_a_flood_that_cycles_the_pool(
    server: Server, breakpoint: bool
) -> None:
    client, stream = _client(server), False
    block: dict[str, Any] = {"type": "text", "text": SYSTEM}
    if breakpoint:
        block["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    question = [{"role": "user", "content": "Where is my parcel?"}]
    warm = _message(client, stream, max_tokens=0, system=[block], messages=question).usage
    assert warm.cache_read_input_tokens == 0
    assert warm.cache_creation_input_tokens > 64 if breakpoint else warm.cache_creation_input_tokens == 0
    _flood(server.url, seed=1)
    other = [{"role": "user", "content": "When does it arrive?"}]
    later = _message(client, stream, max_tokens=2, system=[block], messages=other).usage
    if breakpoint:
        # The retained blocks, at least: the system block's, which the other question shares.
        assert later.cache_read_input_tokens >= warm.cache_creation_input_tokens
    else:
        assert later.cache_read_input_tokens == 0
    assert_no_leak(server.wait_idle())


def _tenant_queries(url: str) -> float:
    r = httpx.get(f"{url}/metrics")
    assert r.status_code == 200
    return sum(
        sample.value
        for family in text_string_to_metric_families(r.text)
        for sample in family.samples
        if sample.name == "kvserve_tenant_prefix_cache_queries_total"
    )


def test_a_prewarm_counts_in_its_tenants_figures(server: Server) -> None:
    before = _tenant_queries(server.url)
    warm = _client(server).messages.create(
        model=NAME, max_tokens=0, system=SYSTEM, messages=[{"role": "user", "content": "Hi."}]
    )
    assert _tenant_queries(server.url) - before == _prompt(warm.usage)
    stats = server.wait_idle()
    assert stats.prompt_tokens >= _prompt(warm.usage)
