"""The sliding pool's rules (cache/sliding_pool.py) on their own: the window, the usable prefix, the
references a sequence's entries hold, and NoSlidingPool's nothing."""

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.cache.block_pool import RELEASED, BlockPool
from kvserve.cache.sequence_blocks import SequenceBlocks
from kvserve.cache.sliding_pool import NO_SLIDING_POOL, SlidingPool

BS = 4


def _usable_by_definition(pool: SlidingPool, dead: Sequence[bool], num_tokens: int) -> int:
    """The most leading blocks whose prefix's window holds no tombstone (the tokens of all of them:
    `num_tokens`, of fewer: whole blocks)."""
    for m in range(len(dead), 0, -1):
        end = num_tokens if m == len(dead) else m * BS
        if not any(dead[pool.first_read(end) // BS : m]):
            return m
    return 0


@given(
    dead=st.lists(st.booleans(), max_size=12),
    window=st.integers(1, 3 * BS),
    partial=st.integers(0, BS - 1),
)
def test_the_usable_prefix_is_the_longest_whose_window_is_whole(
    dead: list[bool], window: int, partial: int
) -> None:
    pool = SlidingPool(BlockPool(4), window, BS)
    num_tokens = max(0, len(dead) * BS - partial) if dead else 0
    assert pool.usable(dead, num_tokens) == _usable_by_definition(pool, dead, num_tokens)


def test_the_window_starts_where_the_next_token_reads() -> None:
    pool = SlidingPool(BlockPool(4), 6, BS)
    # The token after 24 computed ones reads positions 19..24: blocks 4 and 5.
    assert pool.first_read(24) == 19 and pool.first_read(3) == 0
    assert pool.window_blocks([10, 11, 12, 13, 14, 15], 24) == (RELEASED,) * 4 + (14, 15)
    with pytest.raises(AssertionError):
        pool.window_blocks([10, 11, 12, 13, None, 15], 24)


def _sequence(pool: SlidingPool, num_blocks: int) -> SequenceBlocks:
    seq = SequenceBlocks("", blocks=list(range(num_blocks)))
    assert pool.grow(seq, num_blocks, lambda n: 0)
    return seq


@given(steps=st.lists(st.integers(0, 40), min_size=1, max_size=8), window=st.integers(1, 3 * BS))
def test_a_sequence_releases_exactly_the_blocks_before_its_window(steps: list[int], window: int) -> None:
    pool = SlidingPool(BlockPool(16), window, BS)
    seq = _sequence(pool, 10)
    computed = 0
    for n in steps:
        computed = max(computed, n)
        pool.release_passed(seq, computed)
        passed = pool.first_read(computed) // BS
        assert seq.num_released == passed
        assert seq.sliding[:passed] == [RELEASED] * passed and RELEASED not in seq.sliding[passed:]
        assert pool.num_used == 10 - passed
    pool.let_go(seq)
    assert pool.num_used == 0 and seq.sliding == [] and seq.num_released == 0


def test_growth_tombstones_when_short_and_takes_nothing_when_it_cannot() -> None:
    pool = SlidingPool(BlockPool(4), 8, BS)
    seq = _sequence(pool, 3)
    asked: list[int] = []

    def evict(n: int) -> int:
        asked.append(n)
        return 0

    assert not pool.grow(seq, 2, evict)
    assert asked == [1] and len(seq.sliding) == 3 and pool.num_free == 1
    assert pool.grow(seq, 1, evict) and asked == [1] and pool.num_free == 0


def test_holding_a_match_and_its_copy_source_takes_one_reference_each() -> None:
    pool = SlidingPool(BlockPool(8), 6, BS)
    owner = _sequence(pool, 3)
    seq = SequenceBlocks("", blocks=[0, 1, 2])
    pool.hold(seq, [RELEASED, owner.sliding[1], owner.sliding[2]])
    assert seq.num_released == 1 and pool.pool.ref_count(owner.sliding[1]) == 2
    pool.hold_copy_source(seq, owner.sliding[0])
    assert pool.pool.ref_count(owner.sliding[0]) == 2
    pool.drop_copy_source(seq)
    pool.let_go(seq)
    assert all(pool.pool.ref_count(b) == 1 for b in owner.sliding)


def test_keep_usable_cuts_a_landed_run_at_a_tombstone_in_its_window() -> None:
    pool = SlidingPool(BlockPool(8), 6, BS)
    seq = _sequence(pool, 4)
    # Block 2 landed without its sliding part: the window of 16 tokens (positions 11..16) reads it.
    pool.pool.release(seq.sliding[2])
    seq.sliding[2] = RELEASED
    assert pool.keep_usable(seq) == 2
    pool.truncate(seq, 2)
    # The window of 8 tokens reads positions 3..8: blocks 0 and 1, both held.
    assert seq.sliding == [0, 1]
    assert seq.num_released == 0 and pool.num_used == 2


def test_no_sliding_pool_holds_nothing_and_finds_every_prefix_usable() -> None:
    seq = SequenceBlocks("", blocks=[3, 4, 5])
    none = NO_SLIDING_POOL
    assert not none.enabled and none.first_read(100) == 0
    assert none.usable([True, True], 8) == 2 and none.window_blocks([None, None], 8) == ()
    assert none.grow(seq, 3, lambda n: pytest.fail("nothing to tombstone")) and seq.sliding == []
    assert none.table(seq) is None and none.entries(seq, 3) is None
    assert none.keep_usable(seq) == 3 and none.landing(seq, 0) is None
    assert none.free_blocks(7) == 7 and none.take(3) is None
    none.check([seq], {("", (1,)): None}, [], [])
    seq.sliding = [1]
    with pytest.raises(AssertionError, match="without a sliding pool"):
        none.check([seq], {}, [], [])


def test_tombstoning_takes_old_positions_then_the_least_recent_then_the_earliest() -> None:
    pool = SlidingPool(BlockPool(4), 6, BS)
    # The leaf below ends at 24: its window reads from position 19, so a node ending at 8 is old.
    assert pool.tombstone_order(8, 24, 9) < pool.tombstone_order(24, 24, 1)
    assert pool.tombstone_order(24, 24, 1) < pool.tombstone_order(24, 24, 2)
    # A path published together is equally recent: its earlier positions go first.
    assert pool.tombstone_order(20, 24, 5) < pool.tombstone_order(24, 24, 5)
