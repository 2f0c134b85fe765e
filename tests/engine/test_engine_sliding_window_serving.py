"""A sliding-window model serves prompts far past its window (the context is no longer capped at the
window), and a second request with the same long prefix finds it cached, with the no-cache engine's
greedy tokens."""

from collections.abc import Callable

import pytest
import torch

from kvserve.cache.manager import RELEASED
from kvserve.cache.sliding_pool import SlidingPool
from kvserve.engine.outputs import RequestDelta
from kvserve.model.loader import LoadedModel
from tests.harness import (
    MAX_MODEL_LEN,
    Spec,
    assert_matches_reference,
    assert_no_leak,
    drive,
    engine_with_blocks,
    reference_outputs,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(("kind", "window"), [("all", 8), ("hybrid", 3)])
@pytest.mark.parametrize("attention", ["native", "torch"])
def test_a_prompt_far_past_the_window_is_served_and_its_prefix_hits(
    sliding_model: Callable[[str, int], LoadedModel], kind: str, window: int, attention: str
) -> None:
    model = sliding_model(kind, window)
    engine = engine_with_blocks(model, 200, 4, attention=attention)
    assert engine.max_model_len == MAX_MODEL_LEN
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(100, 4096, (400,), generator=gen).tolist()
    specs = [Spec(("system", 0), [], 8), Spec(("repeat", 0), [7, 8, 9], 8)]
    try:
        run = drive(engine, [prompt], specs)
        reference = engine_with_blocks(model, 256, 16, enable_prefix_caching=False, attention="torch")
        assert_matches_reference(run, reference_outputs(reference, run))
        assert run.cached[(1, 0)] == 400
        assert_no_leak(engine)
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("kind", "window", "block_size"), [("all", 8, 4), ("hybrid", 3, 1), ("hybrid", 13, 4)]
)
@pytest.mark.parametrize("attention", ["native", "torch"])
def test_a_running_sequence_holds_only_its_window_of_sliding_blocks(
    sliding_model: Callable[[str, int], LoadedModel],
    kind: str,
    window: int,
    block_size: int,
    attention: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the prefix cache off the sliding layers have a pool of their own, and a sequence lets go of
    each sliding block once every window has passed it: however long the context, between steps it holds
    ceil(window / block_size) + 1 of them at most, and its tokens are the one-pool engine's."""
    model = sliding_model(kind, window)
    engine = engine_with_blocks(
        model, 200, block_size, attention=attention, enable_prefix_caching=False, max_num_batched_tokens=8
    )
    sliding = engine.kv.sliding
    assert isinstance(sliding, SlidingPool)
    held: list[int] = []
    step = engine.step

    def counted_step() -> list[RequestDelta]:
        deltas = step()
        held.append(sliding.num_used)
        return deltas

    monkeypatch.setattr(engine, "step", counted_step)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(100, 4096, (300,), generator=gen).tolist()
    try:
        run = drive(engine, [prompt], [Spec(("system", 0), [], 12)])
        reference = engine_with_blocks(model, 256, 16, enable_prefix_caching=False, attention="torch")
        assert_matches_reference(run, reference_outputs(reference, run))
        assert max(held) <= -(-window // block_size) + 1
        assert_no_leak(engine)
        assert sliding.num_used == 0
    finally:
        engine.close()


def test_only_a_sliding_model_gets_a_sliding_pool(
    tiny_model: LoadedModel, sliding_model: Callable[[str, int], LoadedModel]
) -> None:
    """A model without sliding layers keeps one pool and one K/V tensor over every layer, with the cache
    on or off; a sliding model splits with the cache on as with it off (the tree keeps sliding blocks
    and tombstones), and keeps one pool where the split would shrink it."""
    for caching in (False, True):
        plain = engine_with_blocks(tiny_model, 64, 4, enable_prefix_caching=caching)
        cache = plain.runner.kv_cache
        assert not plain.kv.sliding.enabled and cache.num_sliding_layers == 0 and not cache.shared_ids
        assert cache.k.shape[0] == tiny_model.config.num_layers and cache.sliding_k.numel() == 0
        plain.close()
    hybrid = sliding_model("hybrid", 3)
    for caching in (False, True):
        split = engine_with_blocks(hybrid, 64, 4, enable_prefix_caching=caching, max_num_batched_tokens=8)
        assert isinstance(split.kv.sliding, SlidingPool) and split.num_blocks >= 64
        assert split.runner.kv_cache.sliding_k.shape[1] == split.kv.sliding.num_blocks * 4
        split.close()
    # A chunk of 1,024 tokens needs more sliding blocks than the split leaves a pool of 64.
    one = engine_with_blocks(hybrid, 64, 4)
    assert not one.kv.sliding.enabled and one.runner.kv_cache.shared_ids
    one.close()


@pytest.mark.parametrize(
    ("kind", "window", "block_size", "num_blocks"),
    [("all", 8, 4, 20), ("hybrid", 3, 1, 400), ("hybrid", 13, 4, 100)],
)
def test_with_the_cache_on_a_prompt_far_past_the_window_stays_bounded_and_hits_again(
    sliding_model: Callable[[str, int], LoadedModel],
    kind: str,
    window: int,
    block_size: int,
    num_blocks: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The prefix cache on: the sliding layers still have their own pool, smaller than the prompt, and a
    running sequence holds ceil(window / block_size) + 1 sliding blocks at most between steps; the tree
    keeps the prompt's last window, so that its repeat hits the whole prompt, with the one-pool engine's
    tokens."""
    model = sliding_model(kind, window)
    engine = engine_with_blocks(model, num_blocks, block_size, max_num_batched_tokens=8)
    pool = engine.kv.sliding
    assert isinstance(pool, SlidingPool) and engine.kv.prefix_cache.enabled
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(100, 4096, (300,), generator=gen).tolist()
    assert pool.num_blocks * block_size < len(prompt) // 2
    held: list[int] = []
    step = engine.step

    def counted_step() -> list[RequestDelta]:
        deltas = step()
        held.extend(
            sum(b != RELEASED for b in r.kv.sliding) for r in engine.scheduler.running if r.kv is not None
        )
        engine.kv.check()
        return deltas

    monkeypatch.setattr(engine, "step", counted_step)
    specs = [Spec(("system", 0), [], 6), Spec(("repeat", 0), [7, 8, 9], 6)]
    try:
        run = drive(engine, [prompt], specs)
        reference = engine_with_blocks(model, 256, 16, enable_prefix_caching=False, attention="torch")
        assert_matches_reference(run, reference_outputs(reference, run))
        assert max(held) <= -(-window // block_size) + 1
        assert engine.kv.prefix_cache.num_tombstoned > 0
        assert run.cached[(1, 0)] == 300
        assert_no_leak(engine)
    finally:
        engine.close()
