"""Named regression tests for the scheduler and cache failures found in review, each in its own scenario."""

from collections.abc import Sequence

import pytest

from kvserve.cache.loader import LoadJob
from kvserve.engine.engine import Engine
from kvserve.model.loader import LoadedModel
from tests.harness import (
    Spec,
    assert_cached_kv_is_fresh,
    assert_matches_reference,
    assert_no_leak,
    drive,
    engine_with_blocks,
    greedy,
    reference_outputs,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def reference(tiny_model: LoadedModel) -> Engine:
    return engine_with_blocks(tiny_model, 512, 16, enable_prefix_caching=False)


def _tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def _check(
    engine: Engine, reference: Engine, model: LoadedModel, systems: list[list[int]], specs: list[Spec]
) -> None:
    run = drive(engine, systems, specs, check_each_step=False, max_steps=500)
    assert_matches_reference(run, reference_outputs(reference, run))
    assert_no_leak(engine)
    assert_cached_kv_is_fresh(engine, model, sample=64)


def test_failure_1_admissions_in_one_step_never_use_a_block_another_admission_evicted(
    tiny_model: LoadedModel, reference: Engine
) -> None:
    """Three prompts (8, 8, 4 tokens) cached in a pool of 8 blocks of 4, then three extensions of them
    admitted in the same step: the first admission evicts, and a match taken before it went stale."""
    engine = engine_with_blocks(tiny_model, 8, 4)
    systems = [_tokens(100, 8), _tokens(200, 8), _tokens(300, 4)]
    specs = [
        Spec(("system", 0), [], 1, arrival=0),
        Spec(("system", 1), [], 1, arrival=1),
        Spec(("system", 2), [], 1, arrival=2),
        Spec(("system", 0), _tokens(400, 13), 4, arrival=5),
        Spec(("system", 1), _tokens(500, 1), 4, arrival=5),
        Spec(("system", 2), _tokens(600, 3), 4, arrival=5),
        # Later requests on the same prefixes must not inherit a corrupted tree.
        Spec(("system", 1), _tokens(700, 2), 3, arrival=30),
        Spec(("system", 2), _tokens(800, 1), 3, arrival=30),
    ]
    _check(engine, reference, tiny_model, systems, specs)


def test_failure_2_a_one_token_prompt_chunk_is_not_filed_as_a_decode(
    tiny_model: LoadedModel, reference: Engine
) -> None:
    """Cached prompts of 12 and 8 tokens, then extensions by 9 and 3 tokens admitted together under a
    budget of 10: the second gets a one-token chunk in the middle of its prompt, which samples nothing."""
    engine = engine_with_blocks(tiny_model, 64, 4, max_num_batched_tokens=10)
    systems = [_tokens(100, 12), _tokens(200, 8)]
    specs = [
        Spec(("system", 0), [], 1, arrival=0),
        Spec(("system", 1), [], 1, arrival=3),
        Spec(("system", 0), _tokens(300, 9), 3, arrival=6),
        Spec(("system", 1), _tokens(400, 3), 3, arrival=6),
    ]
    _check(engine, reference, tiny_model, systems, specs)


def test_failure_4_a_prompt_that_fills_the_pool_with_a_partial_hit_is_admitted(
    tiny_model: LoadedModel, reference: Engine
) -> None:
    """A pool of 4 blocks of 4; a 6-token prompt leaves a partial block cached; a 15-token prompt that
    extends it needs the whole pool, and would need one block more to keep its copy-on-write source."""
    engine = engine_with_blocks(tiny_model, 4, 4)
    systems = [_tokens(100, 6)]
    specs = [
        Spec(("system", 0), [], 1, arrival=0),
        Spec(("system", 0), _tokens(200, 9), 1, arrival=2),
    ]
    _check(engine, reference, tiny_model, systems, specs)


def test_partial_hits_are_exact_and_copied_when_the_pool_has_room(
    tiny_model: LoadedModel, reference: Engine
) -> None:
    engine = engine_with_blocks(tiny_model, 16, 4)
    systems = [_tokens(100, 6)]
    specs = [Spec(("system", 0), [], 2, arrival=0), Spec(("system", 0), _tokens(200, 5), 2, arrival=4)]
    run = drive(engine, systems, specs)
    assert_matches_reference(run, reference_outputs(reference, run))
    # The second prompt's first 6 tokens (one full block and two of a partial one) came from the cache.
    assert engine.scheduler.counters.cache_hits == 6
    assert_no_leak(engine)


def test_an_empty_step_with_work_left_is_an_error_not_a_spin(
    tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_with_blocks(tiny_model, 8, 4)
    engine.add_request("a", _tokens(100, 5), greedy(2))

    def refuse(
        namespace: str, tokens: Sequence[int], budget: int, max_cached: int | None, load: LoadJob | None
    ) -> None:
        return None

    monkeypatch.setattr(engine.kv, "admit", refuse)
    with pytest.raises(RuntimeError, match="made no progress"):
        engine.step()
