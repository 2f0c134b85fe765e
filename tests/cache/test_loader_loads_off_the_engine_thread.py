"""Blocks from a lower tier are read off the engine thread while their request waits: the loading state
through the engine's small odd configurations (block size 1, a pool that fits one request, a 1-token
budget), a request aborted while it loads, a load whose budget ends before its blocks arrive, and n
samples of one prompt; outputs token for token against a no-cache engine (float64 tiny model, see
tests/harness.py), every step's accounting checked, no leak."""

import threading
from pathlib import Path

import pytest

from kvserve.cache.disk_tier import DiskTier
from kvserve.engine.engine import Engine
from kvserve.model.loader import LoadedModel
from tests.cache.disk_harness import DOCUMENTS, disk_engine, rounds, run_and_check
from tests.harness import Spec, assert_no_leak, drive, engine_with_blocks, greedy

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    ("block_size", "num_blocks", "budget"),
    [
        (1, 96, 300),  # block size 1: a block per token, a load per prompt token
        (4, 12, 300),  # a pool that fits one 42-token request and no more
        (4, 24, 1),  # one token a step: every admission's first chunk is a single token
    ],
)
def test_odd_configs_load_through_the_waiting_state(
    tiny_model: LoadedModel,
    reference: Engine,
    engines: list[Engine],
    tmp_path: Path,
    block_size: int,
    num_blocks: int,
    budget: int,
) -> None:
    engine = engine_with_blocks(
        tiny_model, num_blocks, block_size, kv_disk=str(tmp_path), max_num_batched_tokens=budget
    )
    engines.append(engine)
    # Spaced so that even at one token a step each round has left memory before the next comes back.
    specs = [
        Spec(base=("system", d), suffix=[200 + r, 300 + d], max_tokens=3, arrival=r * 500 + d * 50)
        for r in range(2)
        for d in range(len(DOCUMENTS))
    ]
    run_and_check(engine, reference, specs)
    assert engine.scheduler.counters.loads > 0
    assert engine.stats().hits_by_tier.get("disk", 0) > 0
    assert engine.kv.loads_pending == 0


def test_n_samples_and_repeats_share_what_one_load_brought(
    tiny_model: LoadedModel, reference: Engine, engines: list[Engine], tmp_path: Path
) -> None:
    engine = disk_engine(tiny_model, tmp_path, engines)
    specs = rounds(1) + [
        Spec(base=("system", d), suffix=[400 + d], max_tokens=3, arrival=60 + d, n=3) for d in range(4)
    ]
    run = run_and_check(engine, reference, specs)
    assert engine.scheduler.counters.loads > 0
    assert all(run.cached[(8 + d, j)] >= 40 for d in range(4) for j in range(3))


def test_a_request_aborted_while_it_loads_leaves_nothing(
    tiny_model: LoadedModel, engines: list[Engine], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = disk_engine(tiny_model, tmp_path, engines)
    drive(engine, DOCUMENTS, rounds(1))
    engine.kv.reset_prefix_cache()
    gate = threading.Event()
    load = DiskTier.load

    def held(self: DiskTier, *args: object, **kwargs: object) -> object:
        gate.wait(30)
        return load(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(DiskTier, "load", held)
    engine.add_request("loading", DOCUMENTS[0] + [1, 2], greedy(3))
    engine.add_request("other", [5, 6, 7], greedy(3))
    engine.step()
    assert engine.kv.loads_pending == 1
    assert engine.requests["other"].num_output_tokens == 1
    assert engine.abort_request("loading")
    assert engine.kv.loads_pending == 0
    gate.set()
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv.flush()
    assert_no_leak(engine)


def test_a_load_over_its_budget_admits_with_what_arrived(
    tiny_model: LoadedModel,
    reference: Engine,
    engines: list[Engine],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = disk_engine(tiny_model, tmp_path, engines)
    drive(engine, DOCUMENTS, rounds(1))
    engine.kv.reset_prefix_cache()
    assert engine.kv.tiers.enabled
    engine.kv.tiers.set_budget(0.5)
    gate = threading.Event()
    load = DiskTier.load
    calls = 0

    def third_blocks(self: DiskTier, *args: object, **kwargs: object) -> object:
        # The first two blocks come at once; the third waits past the budget.
        nonlocal calls
        calls += 1
        if calls == 3:
            gate.wait(30)
        return load(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(DiskTier, "load", third_blocks)
    prompt = DOCUMENTS[0] + [1, 2]
    engine.add_request("late", prompt, greedy(4))
    out: list[int] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out += delta.token_ids
            cached = delta.num_cached_tokens
        engine.kv.check()
    gate.set()
    engine.kv.flush()
    assert cached == 2 * 4
    reference.add_request("ref", prompt, greedy(4))
    want: list[int] = []
    while reference.has_unfinished_requests():
        for delta in reference.step():
            want += delta.token_ids
    assert out == want
    assert_no_leak(engine)
