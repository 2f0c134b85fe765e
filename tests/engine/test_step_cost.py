"""Speculation's cost model, measured (engine/step_cost.py, engine/cost_probe.py).

- The estimator finds known row costs from synthetic step times, through outliers, and any timing value
  or count leaves it finite and within its bounds.
- The drafter drafts nothing where rows are measured dear (a fake slow clock) and drafts a copy where
  they are cheap.
- The startup probe leaves the cache as it found it: the free list in its order, no prefix-cache entry,
  no reply remembered, no request counted.
- On the default model, the engine with its probe gives speculation off's greedy tokens.
- A probe left for later (a server's, run once it listens) runs a step at a time, each leaving the cache as
  it was, gives the costs the probe at construction gives, is finished by the first step before it
  schedules, and runs on the AsyncEngine's thread once started, its pings answered before then.
"""

import asyncio
import math
import random
import time
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.cost_probe import ROUNDS, SHAPES
from kvserve.engine.drafting import Drafter
from kvserve.engine.engine import Engine
from kvserve.engine.factory import build_parts
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.step_cost import (
    MAX_ROW_SHARE,
    MAX_STEP_S,
    MIN_BUCKET_STEPS,
    MIN_FIXED_SHARE,
    MIN_ROW_SHARE,
    MIN_STEP_S,
    LoadCostEstimator,
    StepCostEstimator,
    StepCosts,
    load_bucket,
)
from kvserve.model.loader import LoadedModel
from kvserve.model.runner import ForwardBatch, StepLogits
from tests.harness import RowClock

TRUE = StepCosts(fixed=0.010, decode=0.004, draft=0.005, prefill=0.0005)


def _shapes(rng: random.Random) -> tuple[int, int, int]:
    """A step's decode rows, draft rows and prefill tokens, as serving mixes them."""
    decodes = rng.randint(0, 8)
    drafts = rng.choice([0, 0, rng.randint(1, 16)]) if decodes else 0
    prefill = rng.choice([0, 0, 0, rng.randint(1, 1024)])
    return max(decodes, 0 if prefill else 1), drafts, prefill


def _close(got: StepCosts, want: StepCosts, tolerance: float) -> bool:
    return all(
        math.isclose(g, w, rel_tol=tolerance) for g, w in zip(got.as_vector(), want.as_vector(), strict=True)
    )


def test_the_fit_converges_to_known_costs() -> None:
    rng = random.Random(0)
    estimator = StepCostEstimator(1.0)  # rows as dear as the fixed part: twice the truth's decode
    for _ in range(3000):
        decodes, drafts, prefill = _shapes(rng)
        noise = 1 + rng.uniform(-0.03, 0.03)
        estimator.observe(decodes, drafts, prefill, TRUE.time(decodes, drafts, prefill) * noise)
    assert _close(estimator.costs, TRUE, 0.05), estimator.costs
    assert math.isclose(estimator.costs.row_share(4), TRUE.row_share(4), rel_tol=0.05)


def test_the_fit_follows_a_change_of_load() -> None:
    rng = random.Random(1)
    estimator = StepCostEstimator(1.0)
    slower = StepCosts(TRUE.fixed, TRUE.decode, 3 * TRUE.draft, TRUE.prefill)
    for costs in (TRUE, slower):
        for _ in range(2000):
            decodes, drafts, prefill = _shapes(rng)
            estimator.observe(decodes, drafts, prefill, costs.time(decodes, drafts, prefill))
    assert _close(estimator.costs, slower, 0.05), estimator.costs


def test_outliers_barely_move_the_fit() -> None:
    """One step in 20 taking 20 times as long (the process paused, another job on the cores)."""
    rng = random.Random(2)
    estimator = StepCostEstimator(1.0)
    for i in range(3000):
        decodes, drafts, prefill = _shapes(rng)
        seconds = TRUE.time(decodes, drafts, prefill) * (20 if i % 20 == 7 else 1)
        estimator.observe(decodes, drafts, prefill, seconds)
    assert _close(estimator.costs, TRUE, 0.15), estimator.costs


def test_prefill_never_seen_keeps_its_anchor_and_a_draft_row_costs_a_decode_row() -> None:
    estimator = StepCostEstimator(1.0)
    estimator.anchor(TRUE)
    for _ in range(3000):
        estimator.observe(4, 0, 0, TRUE.time(4, 0, 0))
    assert math.isclose(estimator.costs.prefill, TRUE.prefill, rel_tol=0.05)
    assert math.isclose(estimator.costs.draft, TRUE.decode, rel_tol=0.05)


def test_a_probe_that_judged_draft_rows_dear_stops_drafting_only_until_its_steps_fade() -> None:
    """The probe ran while another process took the cores: its draft rows seemed to cost 1.5 decode
    rows, which made drafting pay only after 20-token matches. Served steps (one sequence, no drafts)
    show no draft row; a drafter must not stay off for good on the probe's word."""
    truth = StepCosts(fixed=0.003, decode=0.0035, draft=0.0035, prefill=0.0002)
    busy = StepCosts(fixed=0.0027, decode=0.0033, draft=0.005, prefill=0.0002)
    estimator = StepCostEstimator(1.0)
    for decodes, drafts in [(1, 0), (1, 4), (4, 0), (4, 4), (1, 8), (2, 2)] * 5:
        estimator.observe(decodes, drafts, 0, busy.time(decodes, drafts, 0))
    estimator.anchor(estimator.costs)
    assert estimator.costs.row_share(1) > 0.8
    for _ in range(2000):
        estimator.observe(1, 0, 0, truth.time(1, 0, 0))
    assert math.isclose(estimator.costs.row_share(1), truth.row_share(1), rel_tol=0.1), estimator.costs


def test_a_fit_below_a_zero_fixed_part_keeps_a_share_of_the_lone_decode() -> None:
    """Steps that grow faster than their rows (a machine getting busier) fit a negative fixed part."""
    estimator = StepCostEstimator(1.0)
    for _ in range(500):
        for decodes, seconds in ((1, 0.010), (4, 0.050)):
            estimator.observe(decodes, 0, 0, seconds)
    costs = estimator.costs
    assert math.isclose(costs.fixed, MIN_FIXED_SHARE * (costs.fixed + costs.decode), rel_tol=1e-9)
    assert math.isclose(costs.time(1, 0, 0), 0.010, rel_tol=0.1)


def _concave(decodes: int, drafts: int, prefill: int) -> float:
    """A step whose time grows as the square root of its rows: weights read once serve every row."""
    return 0.004 + 0.0025 * math.sqrt(decodes + drafts) + 0.0002 * prefill


def test_a_lone_streams_row_share_is_its_own_after_a_burst_of_eight_streams() -> None:
    """One line through steps of one and of eight sequences misjudges both (served after a burst of eight
    streams, one stream's draft rows were fitted at three times its decode row, and nothing was drafted):
    the drafter weighs each load by the steps of its own bucket."""
    rng = random.Random(3)
    estimator = LoadCostEstimator(1.0)
    alone = StepCostEstimator(1.0)  # the one-sequence steps only
    for _ in range(300):
        drafts = rng.choice([0, 0, rng.randint(1, 8)])
        estimator.observe(1, drafts, 0, _concave(1, drafts, 0))
        alone.observe(1, drafts, 0, _concave(1, drafts, 0))
    for _ in range(300):
        drafts = rng.choice([0, 0, rng.randint(1, 16)])
        estimator.observe(8, drafts, 0, _concave(8, drafts, 0))
    assert estimator.costs.at(1) == alone.costs
    line = estimator.overall.costs.row_share(1)
    assert not math.isclose(line, alone.costs.row_share(1), rel_tol=0.3), line
    assert estimator.costs.row_share(8) != line


def test_a_bucket_answers_for_its_loads_only_once_it_has_seen_enough_steps() -> None:
    estimator = LoadCostEstimator(1.0)
    for _ in range(MIN_BUCKET_STEPS):
        estimator.observe(0, 0, 512, _concave(0, 0, 512))  # prompt chunks alone: no load's bucket
    assert estimator.costs.by_load == (None,) * len(estimator.costs.by_load)
    for _ in range(MIN_BUCKET_STEPS - 1):
        estimator.observe(4, 2, 0, _concave(4, 2, 0))
    assert estimator.costs.at(5) == estimator.costs.overall
    estimator.observe(4, 0, 0, _concave(4, 0, 0))
    costs = estimator.costs
    assert costs.at(5) is costs.by_load[load_bucket(4)] and costs.at(5) is not None
    # Loads map to the last bucket at or below them, any count to some bucket.
    assert [load_bucket(n) for n in (-5, 0, 1, 2, 3, 4, 7, 8, 2**70)] == [0, 0, 0, 1, 1, 2, 2, 3, 3]


counts = st.integers(-(2**70), 2**70)
times = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -0.0, -1.0, 1e-300, 1e300])


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.tuples(counts, counts, counts, times), max_size=80), row_cost=times)
def test_any_timing_value_leaves_the_costs_finite_and_bounded(
    steps: list[tuple[int, int, int, float]], row_cost: float
) -> None:
    estimator = LoadCostEstimator(row_cost)
    for decodes, drafts, prefill, seconds in steps:
        estimator.observe(decodes, drafts, prefill, seconds)
        if decodes == 3:
            estimator.anchor(StepCosts(seconds, seconds, -seconds, row_cost))
        for load in (-(2**70), 0, 1, decodes, 2**70):
            costs = estimator.costs.at(load)
            assert MIN_STEP_S <= costs.fixed <= MAX_STEP_S
            for row in (costs.decode, costs.draft, costs.prefill):
                assert MIN_ROW_SHARE * costs.fixed <= row <= MAX_ROW_SHARE * costs.fixed
            share = estimator.costs.row_share(load)
            assert math.isfinite(share) and share > 0


LOOP = [4, 5, 6, 7, 8, 9] * 6 + [4, 5]  # a 32-token match, its continuation certain


def test_the_drafter_drafts_nothing_where_rows_are_dear_and_a_copy_where_they_are_cheap() -> None:
    dear = Drafter(8)
    dear.costs = StepCosts(fixed=0.01, decode=0.01, draft=0.05, prefill=0.005)
    assert dear.propose("r", "ns", LOOP, 8, 1) == []
    cheap = Drafter(8)
    cheap.costs = StepCosts(fixed=0.01, decode=0.0005, draft=0.0005, prefill=0.0002)
    assert cheap.propose("r", "ns", LOOP, 8, 8) == [6, 7, 8, 9, 4, 5, 6, 7]


def _config(**overrides: Any) -> EngineConfig:
    return EngineConfig(
        weight_dtype="q8_0", block_size=4, kv_cache_memory=2**22, max_model_len=256, **overrides
    )


def _engine_on_clock(model: LoadedModel, clock: RowClock, probe_now: bool = True, **overrides: Any) -> Engine:
    parts = build_parts(_config(**overrides), model)
    parts.runner.execute = clock.wrap(parts.runner.execute)  # type: ignore[method-assign,assignment]
    return Engine(parts, clock, probe_now)


COPY = list(range(100, 140)) * 3  # a prompt that repeats itself: its greedy reply is likely to copy too


def _drafted(engine: Engine) -> int:
    engine.add_request("r", COPY, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return engine.stats().spec_draft_tokens


def test_an_engine_whose_rows_are_measured_dear_drafts_nothing(tiny_model: LoadedModel) -> None:
    engine = _engine_on_clock(tiny_model, RowClock(fixed=0.01, row=1.0))
    assert engine.step_costs is not None and engine.step_costs.steps > 0  # the probe ran on this clock
    assert engine.step_costs.costs.row_share(1) > 0.9, engine.step_costs.costs
    assert _drafted(engine) == 0


def test_an_engine_whose_rows_are_measured_cheap_drafts_a_copy(tiny_model: LoadedModel) -> None:
    engine = _engine_on_clock(tiny_model, RowClock(fixed=0.01, row=0.0001))
    assert engine.step_costs is not None and engine.step_costs.costs.row_share(1) < 0.2
    assert _drafted(engine) > 0


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_the_probe_leaves_the_cache_as_it_found_it(tiny_model: LoadedModel, prefix_cache: bool) -> None:
    clock = RowClock(fixed=0.001, row=0.0001)
    engine = _engine_on_clock(tiny_model, clock, enable_prefix_caching=prefix_cache)
    plain = Engine(build_parts(_config(enable_prefix_caching=prefix_cache, speculative="off"), tiny_model))
    assert engine.step_costs is not None and engine.step_costs.steps >= 4 and clock.now > 0
    assert plain.step_costs is None  # no probe where speculation is off
    pool = engine.kv.pool
    assert pool.num_free == pool.num_blocks and pool._free == plain.kv.pool._free
    assert engine.kv.usage() == plain.kv.usage()
    assert engine.kv.usage().num_cached == 0 and len(engine.replies) == 0
    stats = engine.stats()
    assert (stats.prompt_tokens, stats.generation_tokens, stats.cache_queries, stats.spec_drafts) == (
        0,
        0,
        0,
        0,
    )
    engine.kv.check()


def test_an_engine_that_does_not_draft_runs_one_warm_up_step_and_leaves_the_cache_as_it_found_it(
    tiny_model: LoadedModel,
) -> None:
    """One forward pass of one decode row (every weight read once, so that the first request does not map
    them), left for the server to run once it listens, and nothing else: no costs, the pool as it was."""
    clock = RowClock(fixed=0.001, row=0.0001)
    engine = _engine_on_clock(tiny_model, clock, probe_now=False, speculative="off")
    never = Engine(build_parts(_config(speculative="off"), tiny_model), probe_now=False)
    assert engine.probing and clock.now == 0 and engine.step_costs is None
    engine.probe_step()
    assert engine.probing and clock.now == pytest.approx(0.001 + 0.0001)
    engine.probe_step()
    assert not engine.probing and clock.now == pytest.approx(0.001 + 0.0001) and engine.step_costs is None
    assert engine.kv.pool._free == never.kv.pool._free and engine.kv.usage() == never.kv.usage()
    assert engine.kv.usage().num_cached == 0 and engine.stats().prompt_tokens == 0
    engine.kv.check()


def test_greedy_tokens_with_the_probe_on_the_default_model_are_those_without_speculation(
    make_engine: Callable[..., Engine],
) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompt = list(range(1000, 1030)) * 3
    out = {}
    for speculative in ("suffix", "off"):
        engine = make_engine(speculative=speculative)
        engine.add_request("r", prompt, params)
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens += delta.token_ids
        out[speculative] = tokens
        engine.kv.check()
    assert out["suffix"] == out["off"]


def test_a_probe_left_for_later_runs_a_step_at_a_time_and_gives_the_same_costs(
    tiny_model: LoadedModel,
) -> None:
    eager = _engine_on_clock(tiny_model, RowClock(fixed=0.001, row=0.0001))
    later = _engine_on_clock(tiny_model, RowClock(fixed=0.001, row=0.0001), probe_now=False)
    plain = Engine(build_parts(_config(speculative="off"), tiny_model))
    assert later.probing and later.step_costs is not None and later.step_costs.steps == 0
    calls = 0
    while later.probing:
        later.probe_step()
        calls += 1
        assert later.kv.pool._free == plain.kv.pool._free and later.kv.usage() == plain.kv.usage()
    assert eager.step_costs is not None and later.step_costs.steps == eager.step_costs.steps > 1
    # The warm-up, every round's steps, then the kept (fastest) steps and the end, which run nothing.
    assert calls == 1 + ROUNDS * (len(SHAPES) - 1) + later.step_costs.steps + 1
    assert later.step_costs.costs == eager.step_costs.costs
    drafter = later.scheduler.drafter
    assert isinstance(drafter, Drafter) and drafter.costs == later.step_costs.costs
    later.kv.check()


class SpikyClock(RowClock):
    """A RowClock on which the forward passes numbered in `spikes` (from 0) take `extra` seconds more: a
    process that took the cores for a moment."""

    def __init__(self, fixed: float, row: float, spikes: set[int], extra: float) -> None:
        super().__init__(fixed, row)
        self.spikes = spikes
        self.extra = extra
        self.calls = 0

    def wrap(self, execute: Callable[[ForwardBatch], StepLogits]) -> Callable[[ForwardBatch], StepLogits]:
        timed = super().wrap(execute)

        def spiky(batch: ForwardBatch) -> StepLogits:
            if self.calls in self.spikes:
                self.now += self.extra
            self.calls += 1
            return timed(batch)

        return spiky


def test_a_step_slowed_by_another_process_leaves_the_probes_figures_as_they_were(
    tiny_model: LoadedModel,
) -> None:
    """Every shape runs in ROUNDS rounds and keeps its fastest time: a slowed step in one of them (here
    the first round's decode with four draft rows, and the second round's lone decode) changes nothing."""
    calm = _engine_on_clock(tiny_model, RowClock(fixed=0.002, row=0.001))
    busy = _engine_on_clock(tiny_model, SpikyClock(fixed=0.002, row=0.001, spikes={2, 6}, extra=0.02))
    assert calm.step_costs is not None and busy.step_costs is not None
    # The same figures, up to the clock's rounding (its times are differences of sums).
    assert _close(busy.step_costs.costs.overall, calm.step_costs.costs.overall, 1e-9), busy.step_costs.costs


def test_the_first_step_finishes_a_probe_left_for_later(tiny_model: LoadedModel) -> None:
    """Rows measured dear: the probe's costs, taken before the first step schedules, draft nothing."""
    engine = _engine_on_clock(tiny_model, RowClock(fixed=0.01, row=1.0), probe_now=False)
    engine.probe_step()
    assert engine.probing
    assert _drafted(engine) == 0
    assert not engine.probing and engine.step_costs is not None and engine.step_costs.steps > 0


def test_the_async_engine_runs_a_pending_probe_once_started_and_answers_before(
    tiny_model: LoadedModel,
) -> None:
    engine = _engine_on_clock(tiny_model, RowClock(fixed=0.001, row=0.0001), probe_now=False)
    async_engine = AsyncEngine(engine)
    try:
        asyncio.run(async_engine.ping())
        assert engine.probing  # nothing runs it before the server says it listens
        async_engine.start_probe()
        deadline = time.monotonic() + 60
        while engine.probing and time.monotonic() < deadline:
            asyncio.run(async_engine.ping())
        assert not engine.probing and engine.step_costs is not None and engine.step_costs.steps > 0
        assert asyncio.run(async_engine.stats()).prompt_tokens == 0
    finally:
        async_engine.shutdown()
