"""Retention on a real engine: a prompt-cache breakpoint's prefix survives a flood that fills the pool
(and without the retention the same flood evicts it), a tenant over its budget trims its own oldest
retention while another tenant's stays, retentions end on the manager's clock, and retained blocks give
way, as many as needed, when a request could not run otherwise. check() runs after every step
(`drive`). The server's side is tests/server/cache_api/test_retention_metrics.py."""

import math
from typing import Any

import pytest

from kvserve.cache.retention import DROPPED_BUDGET, DROPPED_MEMORY
from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.errors import ConfigError
from kvserve.model.loader import LoadedModel
from tests.harness import Spec, assert_matches_reference, drive, engine_with_blocks, reference_outputs
from tests.helpers import Clock

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4
PREFIX = [100 + (i * 13) % 3000 for i in range(40)]
FLOOD = [[1000 + d * 50 + i for i in range(40)] for d in range(10)]


def cache(engine: Engine, prompts: list[list[int]], namespace: str = "") -> None:
    """Run each prompt once (one token), so that its KV is cached."""
    specs = [
        Spec(base=("system", k), suffix=[], max_tokens=1, namespace=namespace) for k in range(len(prompts))
    ]
    drive(engine, prompts, specs)


def flood(engine: Engine) -> None:
    """Ten 40-token prompts of 2 tokens each, one after another: 110 blocks through a 24-block pool."""
    evicted = engine.kv.usage().num_evicted
    for prompt in FLOOD:
        drive(engine, [prompt], [Spec(base=("system", 0), suffix=[], max_tokens=2)])
    assert engine.kv.usage().num_evicted - evicted >= 60, "the flood did not cycle the pool"


def engine_of(model: LoadedModel, num_blocks: int = 24, **overrides: Any) -> Engine:
    engine = engine_with_blocks(model, num_blocks, BLOCK, **overrides)
    engine.kv.clock = Clock()
    return engine


@pytest.mark.parametrize("retained", [True, False])
def test_a_retained_prefix_survives_a_flood_that_fills_the_pool(
    tiny_model: LoadedModel, retained: bool
) -> None:
    engine = engine_of(tiny_model, retention_budget=0.5)
    cache(engine, [PREFIX])
    if retained:
        assert engine.retain("", PREFIX, [(len(PREFIX), 300.0)]) == [40]
        assert engine.kv.usage().num_retained == 10
    flood(engine)
    if not retained:
        assert engine.kv.cached_prefix_len("", PREFIX) < 40, "without retention the flood evicts the prefix"
        return
    assert engine.kv.cached_prefix_len("", PREFIX) == 40
    # Served from memory, with the tokens of an engine without any cache.
    run = drive(engine, [PREFIX], [Spec(base=("system", 0), suffix=[7, 8], max_tokens=4)])
    assert engine.scheduler.counters.cache_hits >= 40
    reference = engine_with_blocks(tiny_model, 64, BLOCK, enable_prefix_caching=False)
    assert_matches_reference(run, reference_outputs(reference, run))
    assert engine.kv.usage().retentions_dropped == {}


def test_a_tenant_over_its_budget_trims_its_own_oldest_retention_first(tiny_model: LoadedModel) -> None:
    # Each tenant may retain 12 of 40 blocks; three 5-block prefixes are one too many.
    engine = engine_of(tiny_model, 40, retention_budget=0.3, max_retained=0.9)
    first, second, third = ([200 + 20 * k + i for i in range(20)] for k in range(3))
    cache(engine, [first, second, third], "a")
    cache(engine, [first], "b")
    for prompt in (first, second):
        assert engine.retain("a", prompt, [(20, 300.0)]) == [20]
    assert engine.retain("b", first, [(20, 300.0)]) == [20]
    # Refreshing `first` makes `second` the oldest of tenant a.
    clock = engine.kv.clock
    assert isinstance(clock, Clock)
    clock.now = 10.0
    assert engine.retain("a", first, [(20, 300.0)]) == [20]
    assert engine.retain("a", third, [(20, 300.0)]) == [20]
    # 15 blocks: `second` gives up the 3 over, from its end.
    assert sorted(r.tokens for r in engine.kv.retentions("a")) == [
        tuple(p) for p in sorted([first, second[:8], third])
    ]
    assert [r.tokens for r in engine.kv.retentions("b")] == [tuple(first)], "b's retention stays"
    usage = engine.kv.usage()
    assert usage.retained_blocks_dropped == {DROPPED_BUDGET: 3} and usage.retentions_dropped == {}
    assert usage.num_retained == 17
    mine = engine.kv.namespace_usage("a")
    assert (mine.num_retained, mine.max_retained) == (12, 12)
    flood(engine)
    held = {
        (ns, p[0]): engine.kv.cached_prefix_len(ns, p)
        for ns, p in [("a", first), ("a", second), ("a", third), ("b", first)]
    }
    assert held == {("a", first[0]): 20, ("a", second[0]): 8, ("a", third[0]): 20, ("b", first[0]): 20}


def test_a_retention_ends_at_its_ttl_on_the_managers_clock_and_a_refresh_extends_it(
    tiny_model: LoadedModel,
) -> None:
    engine = engine_of(tiny_model, retention_budget=0.5)
    clock = engine.kv.clock
    assert isinstance(clock, Clock)
    cache(engine, [PREFIX])
    engine.retain("", PREFIX, [(40, 300.0)])
    clock.now = 200.0
    engine.retain("", PREFIX, [(40, 300.0)])
    clock.now = 499.0
    flood(engine)
    assert engine.kv.cached_prefix_len("", PREFIX) == 40, "refreshed at 200: held until 500"
    clock.now = 500.0
    flood(engine)
    assert engine.kv.usage().num_retained == 0 and engine.kv.retentions("") == []
    assert engine.kv.cached_prefix_len("", PREFIX) < 40, "an expired retention is evictable"


def test_retained_blocks_give_way_to_a_request_that_needs_the_pool(tiny_model: LoadedModel) -> None:
    """Retention never costs a request its admission: 12 of 24 blocks retained, then one request of 21
    blocks, alone, runs (without giving way the engine would find no progress to make); the retention
    gives up only the 9 blocks the request needs, from its end."""
    engine = engine_of(tiny_model, retention_budget=0.5, max_retained=0.5)
    assert engine.request_pool_tokens == 24 * BLOCK, "retention holds nothing back from requests"
    long_prefix = [300 + i for i in range(48)]
    cache(engine, [long_prefix])
    assert engine.retain("", long_prefix, [(48, 3600.0)]) == [48]
    assert engine.kv.usage().num_retained == 12
    big = [2000 + i for i in range(80)]
    run = drive(engine, [big], [Spec(base=("system", 0), suffix=[], max_tokens=4)])
    assert len(run.outputs[0]) == 4
    usage = engine.kv.usage()
    assert usage.num_retained == 3 and usage.retained_blocks_dropped == {DROPPED_MEMORY: 9}
    assert [r.tokens for r in engine.kv.retentions("")] == [tuple(long_prefix[:12])]
    assert usage.retentions_dropped == {}


def test_breakpoints_that_hold_nothing_are_skipped_and_never_raise(tiny_model: LoadedModel) -> None:
    engine = engine_of(tiny_model, retention_budget=0.5)
    cache(engine, [PREFIX])
    odd: list[object] = [
        (0, 300.0),
        (-4, 300.0),
        (41, 300.0),
        (10**12, 300.0),
        (3, 300.0),
        (40, 0.0),
        (40, -1.0),
        (40, math.nan),
        (40, math.inf),
        (40, "5m"),
        ("40", 300.0),
        (40.0, 300.0),
        (None, None),
        (40,),
        (40, 300.0, 1),
        None,
        "ab",
    ]
    assert engine.retain("", PREFIX, odd) == [0] * len(odd)  # type: ignore[arg-type]
    assert engine.retain("", [10**9, 5, 6, 7], [(4, 300.0)]) == [0], "ids outside the vocabulary"
    assert engine.retain("", [1, 2, 3, 4], [(4, 300.0)]) == [0], "not cached: nothing to hold"
    assert engine.retain("", PREFIX, [(7, 300.0)]) == [4], "rounded down to whole blocks"
    assert engine.retain("", PREFIX, [(40, 10**9)]) == [40]
    assert engine.kv.retentions("")[0].expires_at == 3600.0, "a TTL is held at most an hour"
    engine.kv.check()
    run = drive(engine, [PREFIX], [Spec(base=("system", 0), suffix=[9], max_tokens=2)])
    assert len(run.outputs[0]) == 2


@pytest.mark.parametrize("overrides", [{"enable_prefix_caching": False}, {"max_retained": 0.0}])
def test_retention_off_holds_nothing(tiny_model: LoadedModel, overrides: dict[str, Any]) -> None:
    engine = engine_of(tiny_model, **overrides)
    cache(engine, [PREFIX])
    assert not engine.kv.retention_enabled
    assert engine.retain("", PREFIX, [(40, 300.0)]) == [0]
    assert engine.kv.usage().num_retained == 0


def test_retention_beside_pins(tiny_model: LoadedModel) -> None:
    """Pins keep their own caps; retention is a share of what pins leave."""
    engine = engine_of(tiny_model, 40, max_pinned_tokens=10 * BLOCK, retention_budget=0.5)
    assert engine.request_pool_tokens == 30 * BLOCK
    cache(engine, [PREFIX, FLOOD[0]])
    assert engine.pin("", PREFIX, 60) is not None
    assert engine.retain("", PREFIX, [(40, 300.0)]) == [40], "a pinned prefix may be retained too"
    assert engine.retain("", FLOOD[0], [(40, 300.0)]) == [40]
    # 20 blocks over a budget of 15: the older retention gives up 5; the pin on its blocks stays.
    usage = engine.kv.usage()
    assert (usage.num_pinned, usage.num_retained, usage.max_retained) == (10, 15, 15)
    assert [r.tokens for r in engine.kv.retentions("")] == [tuple(PREFIX[:20]), tuple(FLOOD[0])]
    assert [len(p.tokens) for p in engine.pins("")] == [40]
    engine.kv.check()


@pytest.mark.parametrize(
    "fields",
    [
        {"max_retained": 1.0},
        {"max_retained": -0.1},
        {"max_retained": math.nan},
        {"retention_budget": 1.5},
        {"retention_budget": -1.0},
        {"retention_budget": math.nan},
    ],
)
def test_retention_shares_outside_their_range_are_refused(fields: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match=next(iter(fields))):
        EngineConfig(**fields)  # type: ignore[arg-type]
