"""The reply memory per tenant, over HTTP: bob's flood of salted requests (a namespace each, many times
the memory's bytes) leaves alice's remembered reply, so her next chat turn still reads the reply's KV
from the cache (`cached_tokens`), where one store shared by every tenant lost it and re-tokenized the
reply into other ids."""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.engine.reply_memory import ReplyMemory, entry_bytes
from kvserve.model.loader import LoadedModel
from kvserve.model.tokenizer import MessageDict
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from kvserve.server.http.tenants import Tenants, load_or_create_secret

pytestmark = pytest.mark.usefixtures("one_thread")

KEYS = {"alice": "key-alice-0000", "bob": "key-bob-00000"}
BLOCK = 4
REPLY_TOKENS = 24
# Room for a dozen of these replies in all, half of it per tenant: bob's 40 replies overflow both.
ONE = entry_bytes("n" * 64, "x" * 4 * REPLY_TOKENS, range(REPLY_TOKENS))
CAPACITY = 12 * ONE


@pytest.fixture
def url(
    tmp_path: Path,
    tiny_full_vocab_model: LoadedModel,
    serve_app: Callable[[FastAPI], AbstractContextManager[str]],
) -> Iterator[tuple[str, AsyncEngine]]:
    key_file = tmp_path / "keys"
    key_file.write_text("".join(f"{tenant}:{key}\n" for tenant, key in KEYS.items()))
    tenants = Tenants(load_or_create_secret(str(tmp_path)), key_file=str(key_file))
    config = EngineConfig(block_size=BLOCK, kv_cache_memory=2**24, max_model_len=1024, speculative="off")
    engine = Engine.from_config(config, model=tiny_full_vocab_model)
    engine.replies = ReplyMemory(capacity_bytes=CAPACITY, tenant_bytes=CAPACITY // 2)
    async_engine = AsyncEngine(engine)
    with serve_app(create_app(async_engine, ServerOptions(), tenants)) as address:
        yield address, async_engine


def _post(address: str, tenant: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    r = httpx.post(f"{address}{path}", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def test_bobs_salted_flood_leaves_alices_reply_in_her_next_turns_cache(url: tuple[str, AsyncEngine]) -> None:
    address, async_engine = url
    tokenizer = async_engine.tokenizer
    history: list[MessageDict] = [{"role": "user", "content": "Tell me about the sea, at length please."}]
    chat = {"max_tokens": REPLY_TOKENS, "temperature": 0, "ignore_eos": True}
    first = _post(address, "alice", "/v1/chat/completions", {**chat, "messages": history})
    reply = first["choices"][0]["message"]["content"]
    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And the rivers?"}]
    # The reply's text tokenizes otherwise than its ids (what a lost entry gives): they part early.
    spliced = _post(address, "alice", "/tokenize", {"messages": history})["tokens"]
    retokenized = tokenizer.encode_chat(history)
    reply_end = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    parted = next(i for i, (a, b) in enumerate(zip(spliced, retokenized, strict=False)) if a != b)
    assert parted < reply_end - 2 * BLOCK

    for i in range(40):
        body = {"prompt": f"Flood {i}: count the waves.", "cache_salt": f"salt-{i}", **chat}
        _post(address, "bob", "/v1/completions", body)
    # Bob lost his own oldest replies: the memory was full many times over.
    memory = async_engine.engine.replies
    assert len(memory) < 40 and memory.held("bob") <= CAPACITY // 2

    second = _post(address, "alice", "/v1/chat/completions", {**chat, "messages": history})
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # Her whole first turn, reply included, less the last partial block.
    assert cached >= reply_end - BLOCK, (cached, parted, reply_end)
