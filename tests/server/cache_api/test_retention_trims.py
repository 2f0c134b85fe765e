"""The server-wide retention cap trims, through Anthropic's Messages API (the official client against a
real server on loopback): alice and bob each retain a one-hour system prompt at their whole budget, 22
blocks, under a cap of 45; carol's one 2-block breakpoint then costs the older of the two one block,
never a whole retention. Each reply's `cache_creation_input_tokens` counts what its retention kept (22
blocks), not where its breakpoint fell; the stream's final usage (message_delta) says the same.
"""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from kvserve.engine.async_engine import AsyncEngine
from kvserve.model.loader import LoadedModel
from kvserve.options import ServerOptions
from kvserve.secret import load_or_create_secret
from kvserve.server.app import create_app
from kvserve.server.http.tenants import Tenants
from tests.harness import engine_with_blocks
from tests.server.live import Server, assert_no_leak

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "m"
BLOCK = 16
# 90 blocks: a cap of 45 retained blocks (max_retained 0.5), 22 per tenant (retention_budget 0.25).
NUM_BLOCKS = 90
BUDGET = 22
CAP = 45
KEYS = {"alice": "key-alice-aaaa", "bob": "key-bob-bbbbbb", "carol": "key-carol-cccc"}
ADMIN = "admin-key-0000"
# Two blocks to its breakpoint: carol's whole retention.
CAROL = (
    "Be brief, carol: answer every question about a parcel in one short and friendly sentence, and name "
    "its depot."
)
# About 400 tokens of system prompt: past a tenant's 22-block budget (352 tokens).
LONG = "You are a careful assistant for a shipping company; answer in one short sentence. " * 24


@dataclass
class Tenanted:
    server: Server
    url: str

    def client(self, who: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=KEYS[who], max_retries=0, timeout=300)

    def retained(self, who: str) -> int:
        """The tenant's retained blocks, as its GET /v1/cache shows them."""
        key = ADMIN if who == "admin" else KEYS[who]
        r = httpx.get(f"{self.url}/v1/cache", headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert r.status_code == 200, r.text
        return int(r.json()["tiers"][0]["retained_blocks"])


@pytest.fixture
def tenanted(
    tiny_full_vocab_model: LoadedModel,
    serve_app: Callable[[FastAPI], AbstractContextManager[str]],
    tmp_path: Path,
) -> Iterator[Tenanted]:
    key_file = tmp_path / "keys"
    key_file.write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
    tenants = Tenants(load_or_create_secret(str(tmp_path)), key_file=str(key_file))
    engine = engine_with_blocks(
        tiny_full_vocab_model, NUM_BLOCKS, BLOCK, retention_budget=0.25, max_retained=0.5
    )
    assert engine.kv.usage().max_retained == CAP
    async_engine = AsyncEngine(engine)
    app = create_app(async_engine, ServerOptions(admin_key=ADMIN, served_model_name=NAME), tenants)
    with serve_app(app) as url:
        yield Tenanted(Server(url, async_engine), url)


def _ask(client: anthropic.Anthropic, system: str, ttl: str | None, stream: bool) -> Any:
    control: dict[str, Any] = {"type": "ephemeral"} if ttl is None else {"type": "ephemeral", "ttl": ttl}
    args: dict[str, Any] = {
        "model": NAME,
        "max_tokens": 2,
        "system": [{"type": "text", "text": system, "cache_control": control}],
        "messages": [{"role": "user", "content": "Where is my parcel?"}],
        "extra_body": {"temperature": 0},
    }
    if stream:
        with client.messages.stream(**args) as events:
            (start,) = [e.message.usage for e in events if e.type == "message_start"]
            final = events.get_final_message().usage
        # message_start goes out before the retention: the most the breakpoint could keep, which all of
        # it here was.
        assert start.cache_creation_input_tokens == final.cache_creation_input_tokens
        return final
    return client.messages.create(**args).usage


def test_a_small_breakpoint_over_the_cap_trims_one_block_of_the_oldest(tenanted: Tenanted) -> None:
    kept = BUDGET * BLOCK
    alice = _ask(tenanted.client("alice"), LONG, "1h", stream=False)
    bob = _ask(tenanted.client("bob"), "Bob's desk. " + LONG, "1h", stream=True)
    for usage in (alice, bob):
        prompt = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
        assert prompt > kept + 2 * BLOCK, "the breakpoint falls past the budget"
        # What the retention kept, its first 22 blocks, less what was read from the cache.
        assert usage.cache_creation_input_tokens == kept - usage.cache_read_input_tokens
    assert (tenanted.retained("alice"), tenanted.retained("bob")) == (BUDGET, BUDGET)
    carol = _ask(tenanted.client("carol"), CAROL, None, stream=False)
    assert carol.cache_creation_input_tokens == 2 * BLOCK - carol.cache_read_input_tokens
    # 46 blocks asked for under a cap of 45: the oldest retention (alice's) gives up its last block.
    assert [tenanted.retained(who) for who in ("alice", "bob", "carol")] == [BUDGET - 1, BUDGET, 2]
    assert tenanted.retained("admin") == CAP
    metrics = httpx.get(f"{tenanted.url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    samples = {
        (s.name, s.labels.get("reason")): s.value
        for f in text_string_to_metric_families(metrics.text)
        for s in f.samples
    }
    assert samples[("kvserve_retained_blocks_dropped_total", "server_cap")] == 1
    assert samples[("kvserve_retentions_dropped_total", "server_cap")] == 0
    # Her retention still holds its first 21 blocks: her next turn reads them from the cache.
    again = _ask(tenanted.client("alice"), LONG, "1h", stream=False)
    assert again.cache_read_input_tokens >= (BUDGET - 1) * BLOCK
    assert_no_leak(tenanted.server.wait_idle())
