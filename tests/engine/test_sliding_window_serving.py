"""A sliding-window model serves prompts far past its window (the context is no longer capped at the
window), and a second request with the same long prefix finds it cached, with the no-cache engine's
greedy tokens."""

from collections.abc import Callable

import pytest
import torch

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
