"""Speculation memory per tenant, over HTTP: the server gives the engine the API key's tenant, so bob's
requests with a fresh `cache_salt` each (a namespace each) leave alice's remembered reply, and the draft
tokens her repeat accepts, as they were. Counted from the engine's speculation counters, never from
time; the engine runs on a fake clock (`RowClock`), so what is drafted does not depend on the machine."""

import asyncio
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.drafting import Drafter
from kvserve.engine.engine import Engine
from kvserve.engine.factory import build_parts
from kvserve.model.loader import LoadedModel
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from kvserve.server.http.tenants import Tenants, load_or_create_secret
from tests.engine.test_drafting_tenants import PROMPT, SMALL_BOUNDS
from tests.harness import RowClock

pytestmark = pytest.mark.usefixtures("one_thread")

KEYS = {"alice": "key-alice-0000", "bob": "key-bob-00000"}


@pytest.fixture
def url(
    tmp_path: Path, tiny_model: LoadedModel, serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[tuple[str, AsyncEngine]]:
    key_file = tmp_path / "keys"
    key_file.write_text("".join(f"{tenant}:{key}\n" for tenant, key in KEYS.items()))
    tenants = Tenants(load_or_create_secret(str(tmp_path)), key_file=str(key_file))
    clock = RowClock(fixed=0.01, row=0.0001)
    config = EngineConfig(weight_dtype="q8_0", block_size=4, kv_cache_memory=2**23, max_model_len=512)
    parts = build_parts(config, tiny_model)
    parts.runner.execute = clock.wrap(parts.runner.execute)  # type: ignore[method-assign,assignment]
    engine = Engine(parts, clock)
    # Bounds that bob's requests overflow unless they all count as his (see SMALL_BOUNDS).
    engine.scheduler.drafter = Drafter(config.speculative_tokens, **SMALL_BOUNDS)
    async_engine = AsyncEngine(engine)
    with serve_app(create_app(async_engine, ServerOptions(), tenants)) as address:
        yield address, async_engine


def _complete(address: str, tenant: str, body: dict[str, Any]) -> str:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    r = httpx.post(f"{address}/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    text: str = r.json()["choices"][0]["text"]
    return text


def _accepted(async_engine: AsyncEngine) -> int:
    count: int = asyncio.run(async_engine.call(lambda e: e.stats().spec_accepted_tokens))
    return count


def test_bobs_salted_requests_leave_alices_repeat_its_drafts(url: tuple[str, AsyncEngine]) -> None:
    address, async_engine = url
    alice = {"prompt": PROMPT, "max_tokens": 100, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    first = _complete(address, "alice", alice)
    for i in range(80):  # more than the 64 namespaces the old index kept for everyone, over 2,048 units
        bob = {"prompt": [200 + i, 201, 202, 203], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        _complete(address, "bob", {**bob, "cache_salt": f"salt-{i}"})
    before = _accepted(async_engine)
    assert _complete(address, "alice", alice) == first
    # 86 of her 100 tokens, as without bob's requests (0 when one index served every tenant).
    assert _accepted(async_engine) - before >= 80
