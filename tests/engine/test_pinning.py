"""Pinning: a pinned prefix stays in memory through a flood that evicts everything else, until its TTL
ends or it is unpinned; pins are capped and scoped to their namespace; the HTTP API over it."""

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from kvserve.cache.manager import PinRefused
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.model.loader import LoadedModel
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from tests.harness import Spec, assert_matches_reference, drive, engine_with_blocks, reference_outputs
from tests.helpers import Clock

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4
PINNED = [100 + (i * 13) % 3000 for i in range(40)]
FLOOD = [[1000 + d * 50 + i for i in range(40)] for d in range(10)]


def flood(engine: Engine) -> None:
    run = drive(engine, FLOOD, [Spec(base=("system", d), suffix=[], max_tokens=2) for d in range(len(FLOOD))])
    assert len(run.outputs) == len(FLOOD)


@pytest.fixture
def engine(tiny_model: LoadedModel) -> Engine:
    engine = engine_with_blocks(tiny_model, 24, BLOCK, max_pinned_tokens=11 * BLOCK)
    engine.kv.clock = Clock()
    return engine


def test_a_pinned_prefix_survives_a_flood_until_its_ttl_ends(engine: Engine, tiny_model: LoadedModel) -> None:
    clock = engine.kv.clock
    assert isinstance(clock, Clock)
    assert engine.pin("", PINNED, 60) is None, "nothing is cached yet"
    drive(engine, [PINNED], [Spec(base=("system", 0), suffix=[], max_tokens=1)])
    pin = engine.pin("", PINNED, 60)
    assert pin is not None and len(pin.tokens) == 40
    flood(engine)
    assert engine.kv.cached_prefix_len("", PINNED) == 40
    assert engine.kv.usage().num_pinned == 10
    # The pinned prefix is served from memory, with the same tokens as without any cache.
    reference = engine_with_blocks(tiny_model, 64, BLOCK, enable_prefix_caching=False)
    run = drive(engine, [PINNED], [Spec(base=("system", 0), suffix=[7, 8], max_tokens=4)])
    assert_matches_reference(run, reference_outputs(reference, run))
    clock.now = 61
    assert engine.pins("") == []
    flood(engine)
    assert engine.kv.cached_prefix_len("", PINNED) < 40, "an expired pin is evictable"
    engine.kv.check()


def test_pins_are_capped_scoped_and_removable(engine: Engine) -> None:
    drive(engine, [PINNED, FLOOD[0]], [Spec(base=("system", k), suffix=[], max_tokens=1) for k in (0, 1)])
    first = engine.pin("", PINNED, 10)
    assert first is not None
    again = engine.pin("", [*PINNED, 5, 6], 100)
    assert again is first and again.expires_at == 100, "the same prefix extends its pin"
    with pytest.raises(PinRefused, match="over the cap"):
        engine.pin("", FLOOD[0], 10)
    with pytest.raises(PinRefused, match="shorter than one KV block"):
        engine.pin("", PINNED[:3], 10)
    assert engine.pins("other") == [] and not engine.unpin("other", first.pin_id)
    assert engine.unpin("", first.pin_id)
    assert engine.pin("", FLOOD[0], 10) is not None
    engine.kv.check()
    # Pins may hold 11 of the 24 blocks, so one request may use 13.
    assert engine.request_pool_tokens == 13 * BLOCK


def test_pinning_off_refuses(tiny_model: LoadedModel) -> None:
    engine = engine_with_blocks(tiny_model, 24, BLOCK)
    with pytest.raises(PinRefused, match="pinning is off"):
        engine.pin("", PINNED, 10)


@pytest.fixture
def url(
    tiny_model: LoadedModel, serve_app: Callable[[FastAPI], AbstractContextManager[str]], tmp_path: Path
) -> Iterator[str]:
    engine = engine_with_blocks(tiny_model, 64, BLOCK, max_pinned_tokens=12 * BLOCK, kv_disk=str(tmp_path))
    with serve_app(create_app(AsyncEngine(engine), ServerOptions())) as url:
        yield url


def test_pin_api(url: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as client:
        r = client.post("/v1/cache/pin", json={"prompt": PINNED, "ttl_s": 60})
        assert r.status_code == 200, r.text
        pin = r.json()
        assert pin["object"] == "cache.pin" and pin["pinned_tokens"] == 40 and 0 < pin["expires_in_s"] <= 60
        status = client.get("/v1/cache").json()
        assert [p["id"] for p in status["pins"]] == [pin["id"]]
        memory, disk = status["tiers"]
        assert memory["name"] == "memory" and memory["pinned_blocks"] == 10
        assert disk["name"] == "disk"
        over = client.post("/v1/cache/pin", json={"prompt": FLOOD[0], "ttl_s": 60})
        assert over.status_code == 400 and "over the cap" in over.json()["error"]["message"]
        for body in (
            {"prompt": PINNED, "messages": [{"role": "user", "content": "hi"}], "ttl_s": 5},
            {"prompt": PINNED},
            {"prompt": PINNED, "ttl_s": 0},
            {"prompt": PINNED, "ttl_s": "soon"},
            {"prompt": [1, 2], "ttl_s": 5},
            {"prompt": [10**9] * 8, "ttl_s": 5},
            {"prompt": "", "ttl_s": 5},
        ):
            bad = client.post("/v1/cache/pin", json=body)
            assert bad.status_code == 400, (body, bad.text)
            assert set(bad.json()["error"]) == {"message", "type", "param", "code"}
        assert client.delete(f"/v1/cache/pin/{pin['id']}").json() == {
            "id": pin["id"],
            "object": "cache.pin",
            "deleted": True,
        }
        gone = client.delete(f"/v1/cache/pin/{pin['id']}")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "pin_not_found"

        def scrape() -> dict[tuple[str, str | None], float]:
            return {
                (s.name, s.labels.get("tier")): s.value
                for f in text_string_to_metric_families(client.get("/metrics").text)
                for s in f.samples
            }

        # The pinned prefix's 10 blocks were offered to the disk, written behind: wait for them.
        deadline = time.monotonic() + 30
        metrics = scrape()
        while metrics[("kvserve_kv_tier_blocks", "disk")] < 10 and time.monotonic() < deadline:
            time.sleep(0.1)
            metrics = scrape()
        assert metrics[("kvserve_prefix_cache_hits_by_tier_total", "disk")] == 0
        # Each file holds a block's KV: 4 tokens x 2 layers x (K, V) x 2 heads x 16 dims x 8 bytes.
        blocks = metrics[("kvserve_kv_tier_blocks", "disk")]
        assert blocks >= 10 and metrics[("kvserve_kv_tier_bytes_used", "disk")] >= blocks * 4 * 1024
        assert ("kvserve_kv_tier_load_seconds_count", "disk") in metrics
        assert ("kvserve_kv_tier_store_seconds_bucket", "disk") in metrics


def test_one_namespace_cannot_take_every_pinnable_block(tiny_model: LoadedModel) -> None:
    """Per tenant: namespaces are tenants (or shared groups), each capped below the total."""
    engine = engine_with_blocks(
        tiny_model, 40, BLOCK, max_pinned_tokens=20 * BLOCK, max_pinned_tokens_per_tenant=10 * BLOCK
    )
    drive(
        engine,
        [PINNED],
        [Spec(base=("system", 0), suffix=[], max_tokens=1, namespace=ns) for ns in ("a", "b")],
    )
    drive(engine, [FLOOD[0]], [Spec(base=("system", 0), suffix=[], max_tokens=1, namespace="a")])
    assert engine.pin("a", PINNED, 10) is not None
    with pytest.raises(PinRefused, match="in this namespace, over its cap of 40"):
        engine.pin("a", FLOOD[0], 10)
    assert engine.pin("b", PINNED, 10) is not None, "another namespace has its own share"
    engine.kv.check()
