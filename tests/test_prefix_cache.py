"""PrefixCache and BlockPool on their own: a hypothesis state machine against a reference model."""

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvserve.cache.block_pool import BlockPool
from kvserve.cache.manager import KVCacheManager
from kvserve.cache.prefix_cache import PrefixCache

BS = 4
NUM_BLOCKS = 24
tokens = st.lists(st.integers(0, 3), min_size=1, max_size=5 * BS)
namespaces = st.sampled_from(["", "tenant-a"])


def _lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class CacheMachine(RuleBasedStateMachine):
    """Requests run through the cache as the scheduler drives it: match, lock the hit, allocate the rest,
    insert what was computed, and release (now, or later to model a request still running)."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, enable_prefix_caching=True)
        self.cache = self.kv.prefix_cache
        assert self.cache is not None
        # Reference: the token paths each namespace holds, as the tree lists them.
        self.paths: dict[str, set[tuple[int, ...]]] = {"": set(), "tenant-a": set()}
        self.held: list[list[int]] = []

    def _reference_match(self, namespace: str, query: tuple[int, ...]) -> int:
        return max((_lcp(p, query) for p in self.paths[namespace]), default=0)

    @rule(namespace=namespaces, seq=tokens, keep=st.booleans())
    def run_request(self, namespace: str, seq: list[int], keep: bool) -> None:
        match = self.kv.match(namespace, seq)
        assert match.num_tokens == self._reference_match(namespace, tuple(seq))
        assert len(match.blocks) == match.num_tokens // BS
        self.kv.lock(match.blocks)
        fresh = self.kv.allocate(-(-len(seq) // BS) - len(match.blocks))
        # Allocation may have evicted under pressure; the locked prefix must have survived it.
        self._sync()
        assert all(self.kv.pool.ref_count(b) >= 2 for b in match.blocks)
        if fresh is None:
            self.kv.free(match.blocks)
            return
        table = list(match.blocks) + fresh
        self.kv.cache(namespace, seq, table)
        self._sync()
        if keep:
            self.held.append(table)
        else:
            self.kv.free(table)

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 100))
    def finish_held(self, index: int) -> None:
        self.kv.free(self.held.pop(index % len(self.held)))

    @rule(n=st.integers(1, NUM_BLOCKS))
    def evict(self, n: int) -> None:
        assert self.cache is not None
        before = {(ns, p): b for ns, p, b in self.cache.entries()}
        locked = {b for table in self.held for b in table}
        evictable_before = sum(1 for b in before.values() if self.kv.pool.ref_count(b) == 1)
        freed = self.cache.evict(n)
        after = {(ns, p): b for ns, p, b in self.cache.entries()}
        gone = set(before) - set(after)
        assert len(gone) == freed
        assert freed == min(n, evictable_before)
        assert not {before[k] for k in gone} & locked, "a locked block was evicted"
        self._sync()

    def _sync(self) -> None:
        assert self.cache is not None
        self.paths = {"": set(), "tenant-a": set()}
        for ns, path, _ in self.cache.entries():
            self.paths[ns].add(path)

    @invariant()
    def blocks_add_up(self) -> None:
        assert self.cache is not None
        refs: Counter[int] = Counter(b for _, _, b in self.cache.entries())
        for table in self.held:
            refs.update(table)
        for block, count in refs.items():
            assert self.kv.pool.ref_count(block) == count
        assert self.kv.pool.num_free + len(refs) == NUM_BLOCKS

    @invariant()
    def tree_is_closed_under_prefixes(self) -> None:
        for paths in self.paths.values():
            for p in paths:
                assert len(p) <= BS or p[: (len(p) - 1) // BS * BS] in paths

    @invariant()
    def namespaces_share_no_blocks(self) -> None:
        assert self.cache is not None
        owners: dict[int, set[str]] = {}
        for ns, _, b in self.cache.entries():
            owners.setdefault(b, set()).add(ns)
        assert all(len(v) == 1 for v in owners.values())


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_partial_match_is_exact_to_the_token() -> None:
    pool = BlockPool(8)
    cache = PrefixCache(pool, BS)
    blocks = pool.allocate(3)
    cache.insert("", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], blocks)
    match = cache.match("", [1, 2, 3, 4, 5, 6, 9, 9])
    assert match.num_tokens == 6
    assert match.blocks == (blocks[0],)
    assert match.partial_block == blocks[1]
    assert cache.match("other", [1, 2, 3, 4]).num_tokens == 0


def test_eviction_is_least_recently_used_and_spares_locked_blocks() -> None:
    pool = BlockPool(8)
    cache = PrefixCache(pool, BS)
    old, new = pool.allocate(1), pool.allocate(1)
    cache.insert("", [1, 1, 1, 1], old)
    cache.insert("", [2, 2, 2, 2], new)
    pool.release(old[0])
    pool.release(new[0])
    cache.match("", [1, 1, 1, 1])
    assert cache.evict(1) == 1
    assert cache.match("", [1, 1, 1, 1]).num_tokens == 4
    assert cache.match("", [2, 2, 2, 2]).num_tokens == 0
    pool.ref(old[0])
    assert cache.evict(8) == 0


def test_a_partial_leaf_is_replaced_by_the_block_that_extends_it() -> None:
    pool = BlockPool(8)
    cache = PrefixCache(pool, BS)
    partial = pool.allocate(1)
    cache.insert("", [5, 6], partial)
    pool.release(partial[0])
    full = pool.allocate(1)
    cache.insert("", [5, 6, 7, 8], full)
    assert [b for _, _, b in cache.entries()] == full
    assert pool.ref_count(partial[0]) == 0


def test_pool_refuses_double_free_and_overallocation() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.release(b)
    with pytest.raises(ValueError):
        pool.release(b)
    with pytest.raises(MemoryError):
        pool.allocate(3)
    assert pool.num_free == 2
