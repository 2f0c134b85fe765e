"""Speculation memory per tenant, on the engine: another tenant's salted flood leaves alice's recent
replies, and the drafts they give her repeat, as they were (the review's probe: 64 salted 4-token
requests took her repeat from 87 accepted draft tokens to 1).

Acceptance is counted from the engine's own counters, never from time; the engine's clock is a fake one
(`RowClock`: rows cheap against a step's fixed part), so what is drafted does not depend on the machine."""

import random

import pytest

from kvserve.config import EngineConfig
from kvserve.engine.drafting import Drafter
from kvserve.engine.engine import Engine
from kvserve.engine.factory import build_parts
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.loader import LoadedModel
from tests.harness import RowClock

pytestmark = pytest.mark.usefixtures("one_thread")

RNG = random.Random(0)
PROMPT = [RNG.randrange(100, 4000) for _ in range(40)]
# Sampled with a seed: the same text on a repeat, and, unlike the tiny model's greedy loops, text whose
# drafts come from the remembered reply rather than from the sequence's own tokens.
ALICE = SamplingParams(max_tokens=100, temperature=1.0, seed=7, ignore_eos=True)
BOB = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
# Bounds under which bob's flood fits his own budget and, with it, the total; but not if each of his salted
# namespaces counted as a tenant of its own (200 x 44 units): the total's trim would then take alice's
# reply, the largest holding.
SMALL_BOUNDS = {"tenant_tokens": 1_024, "total_tokens": 2_048}


def _engine(model: LoadedModel, speculative: str = "suffix") -> Engine:
    clock = RowClock(fixed=0.01, row=0.0001)
    config = EngineConfig(
        weight_dtype="q8_0",
        block_size=4,
        kv_cache_memory=2**23,
        max_model_len=512,
        speculative=speculative,
    )
    parts = build_parts(config, model)
    parts.runner.execute = clock.wrap(parts.runner.execute)  # type: ignore[method-assign,assignment]
    return Engine(parts, clock)


def _alice(engine: Engine, request_id: str) -> tuple[list[int], int]:
    """Alice's request run alone: its tokens and the draft tokens accepted for it."""
    before = engine.stats().spec_accepted_tokens
    engine.add_request(request_id, PROMPT, ALICE, "alice-namespace", "alice")
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += delta.token_ids
    return tokens, engine.stats().spec_accepted_tokens - before


def _bob_floods(engine: Engine, count: int) -> None:
    """Bob's `count` 4-token requests, each in a namespace of its own (as `cache_salt` mints them)."""
    for i in range(count):
        prompt = [RNG.randrange(100, 4000) for _ in range(8)]
        engine.add_request(f"bob-{i}", prompt, BOB, f"bob-salt-{i}", "bob")
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize(("flood", "bounds"), [(0, {}), (200, {}), (200, SMALL_BOUNDS)])
def test_another_tenants_salted_flood_leaves_alices_repeat_its_drafts(
    tiny_model: LoadedModel, flood: int, bounds: dict[str, int]
) -> None:
    engine = _engine(tiny_model)
    if bounds:
        engine.scheduler.drafter = Drafter(engine.config.speculative_tokens, **bounds)
    first, accepted_first = _alice(engine, "alice-1")
    _bob_floods(engine, flood)
    repeat, accepted_repeat = _alice(engine, "alice-2")
    assert repeat == first
    # Her first reply drafts little from its own text; her repeat drafts nearly all of it from her
    # remembered reply, after bob's flood as without it (86 of 100 tokens here; 0 before the fix).
    assert accepted_first < 20
    assert accepted_repeat >= 80
    # And the drafts change nothing: speculation off writes the same.
    plain = _engine(tiny_model, "off")
    assert _alice(plain, "alice")[0] == first
