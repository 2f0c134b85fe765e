"""The cache layer on its own: a hypothesis state machine against an independent reference model."""

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvserve.cache.block_pool import BlockPool
from kvserve.cache.manager import KVCacheManager, SequenceBlocks
from kvserve.cache.prefix_cache import PrefixCache

BS = 4
NUM_BLOCKS = 24
tokens = st.lists(st.integers(0, 3), min_size=1, max_size=5 * BS)
namespaces = st.sampled_from(["", "tenant-a"])

Key = tuple[str, tuple[int, ...]]


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _under(q: tuple[int, ...], p: tuple[int, ...]) -> bool:
    """Whether path q is p or lies in p's subtree. Only a full-block path has a subtree: a partial block
    is a leaf, even when a sibling's full block starts with its tokens (the sibling is no child of it)."""
    return q == p or (len(p) % BS == 0 and q[: len(p)] == p)


@dataclass
class _Entry:
    block: int
    last_use: int


@dataclass
class _Live:
    seq: SequenceBlocks
    tokens: list[int]
    computed: int


class Reference:
    """What the prefix cache should hold, kept independently of it: a flat dict from (namespace, token
    path from the root) to block and last use, with its own clock. Full paths have a multiple of BS
    tokens; a partial path (a tail) has fewer in its last block."""

    def __init__(self) -> None:
        self.entries: dict[Key, _Entry] = {}
        self.clock = 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def children(self, namespace: str, parent: tuple[int, ...]) -> list[tuple[int, ...]]:
        depth = len(parent)
        return [
            p
            for ns, p in self.entries
            if ns == namespace and depth < len(p) <= depth + BS and p[:depth] == parent
        ]

    def match(self, namespace: str, query: Sequence[int]) -> tuple[int, int | None]:
        """(tokens matched, block copied for a partial last block); touches what it matches."""
        now = self.tick()
        k = 0
        while len(query) >= (k + 1) * BS and (namespace, tuple(query[: (k + 1) * BS])) in self.entries:
            k += 1
            self.entries[(namespace, tuple(query[: k * BS]))].last_use = now
        parent = tuple(query[: k * BS])
        rest = query[k * BS : (k + 1) * BS]
        scored = [
            (_lcp(p[k * BS :], rest), self.entries[(namespace, p)].last_use, p)
            for p in self.children(namespace, parent)
        ]
        best = max(scored, default=None)
        if best is None or best[0] == 0:
            return k * BS, None
        entry = self.entries[(namespace, best[2])]
        entry.last_use = now
        return k * BS + best[0], entry.block

    def insert(
        self, namespace: str, path: Sequence[int], blocks: Sequence[int], locked: Counter[int]
    ) -> None:
        now = self.tick()
        for j, block in enumerate(blocks):
            key = tuple(path[: (j + 1) * BS])
            parent = tuple(path[: j * BS])
            tail = key[j * BS :]
            siblings = self.children(namespace, parent)
            if key in siblings:
                self.entries[(namespace, key)].last_use = now
                continue
            if len(tail) < BS and any(s[j * BS :][: len(tail)] == tail for s in siblings):
                return
            for s in siblings:
                # A partial sibling that the new block extends holds nothing more: it goes if unused.
                if (
                    len(s) < len(key)
                    and key[: len(s)] == s
                    and not locked[self.entries[(namespace, s)].block]
                ):
                    del self.entries[(namespace, s)]
            self.entries[(namespace, key)] = _Entry(block, now)

    def removable(self, locked: Counter[int]) -> set[Key]:
        """Entries that eviction can reach: nothing in their subtree is locked."""
        pinned = {k for k, e in self.entries.items() if locked[e.block]}
        return {(ns, p) for ns, p in self.entries if not any(ns == n2 and _under(q, p) for n2, q in pinned)}

    def evictable_leaves(self, locked: Counter[int]) -> set[Key]:
        return {
            (ns, p)
            for ns, p in self.entries
            if not locked[self.entries[(ns, p)].block]
            and not any(n2 == ns and q != p and _under(q, p) for n2, q in self.entries)
        }


class CacheMachine(RuleBasedStateMachine):
    """Sequences run through the KVCacheManager as the scheduler drives it (admit, grow, compute and
    publish, release) and the prefix cache is checked after every rule against `Reference`: the same
    entries and blocks (so uncomputed KV is never visible and nothing computed is lost), the same match
    lengths and copy sources, evictions in LRU order that spare locked blocks, and exact accounting."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS, enable_prefix_caching=True)
        cache = self.kv.prefix_cache
        assert cache is not None
        self.cache = cache
        self.ref = Reference()
        self.live: list[_Live] = []

    def _locked(self) -> Counter[int]:
        held: Counter[int] = Counter()
        for live in self.live:
            held.update(live.seq.blocks)
            if live.seq.copy_source is not None:
                held[live.seq.copy_source] += 1
        return held

    def _tree(self) -> dict[Key, int]:
        return {(ns, p): b for ns, p, b in self.cache.entries()}

    def _follow_evictions(self, before: set[Key], locked: Counter[int], allowed: int) -> None:
        """Entries the cache dropped since `before` must be LRU among what could go, and unlocked."""
        gone = before - set(self._tree())
        assert len(gone) <= allowed
        survivors = self.ref.evictable_leaves(locked) - gone
        for key in gone:
            assert not locked[self.ref.entries[key].block], "a locked block was evicted"
        newest_gone = max((self.ref.entries[k].last_use for k in gone), default=0)
        oldest_left = min(
            (self.ref.entries[k].last_use for k in survivors if k not in gone), default=newest_gone
        )
        assert newest_gone <= oldest_left, "eviction was not least recently used first"
        for key in gone:
            del self.ref.entries[key]

    @rule(namespace=namespaces, seq=tokens, budget=st.integers(1, 3 * BS))
    def admit(self, namespace: str, seq: list[int], budget: int) -> None:
        before = set(self.ref.entries)
        locked = self._locked()
        expected, copied = self.ref.match(namespace, seq[:-1])
        admission = self.kv.admit(namespace, seq, budget)
        # Blocks a failed or successful admission evicted were unlocked and least recently used.
        self._follow_evictions(before, locked, NUM_BLOCKS)
        if admission is None:
            return
        if admission.copy is not None:
            assert admission.num_cached_tokens == expected
            assert admission.copy[0] == copied
        else:
            # Without a copy, the hit is the full blocks of the match (the partial one was given up).
            assert admission.num_cached_tokens in (expected, expected // BS * BS)
            assert admission.num_cached_tokens % BS == 0 or copied is None
        assert admission.num_new_tokens == min(len(seq) - admission.num_cached_tokens, budget)
        self.live.append(_Live(admission.seq, seq, admission.num_cached_tokens))

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100), n=st.integers(1, 2 * BS))
    def compute(self, index: int, n: int) -> None:
        live = self.live[index % len(self.live)]
        target = min(live.computed + n, len(live.tokens))
        before = set(self.ref.entries)
        locked = self._locked()
        if not self.kv.grow(live.seq, target):
            self._follow_evictions(before, locked, NUM_BLOCKS)
            return
        self._follow_evictions(before, locked, NUM_BLOCKS)
        published = live.seq.num_published
        live.computed = target
        self.kv.publish(live.seq, live.tokens, target)
        full = target // BS
        if full > published:
            self.ref.insert(
                live.seq.namespace, live.tokens[: full * BS], live.seq.blocks[:full], self._locked()
            )

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def release(self, index: int) -> None:
        live = self.live.pop(index % len(self.live))
        computed, blocks = live.computed, list(live.seq.blocks)
        copying = live.seq.copy_source is not None
        self.kv.release(live.seq, live.tokens, computed)
        if computed and not copying:
            self.ref.insert(
                live.seq.namespace, live.tokens[:computed], blocks[: -(-computed // BS)], self._locked()
            )

    @rule(n=st.integers(1, NUM_BLOCKS))
    def evict(self, n: int) -> None:
        before = set(self.ref.entries)
        locked = self._locked()
        removable = len(self.ref.removable(locked))
        freed = self.cache.evict(n)
        assert freed == min(n, removable)
        self._follow_evictions(before, locked, n)

    @invariant()
    def cache_holds_exactly_the_reference(self) -> None:
        assert self._tree() == {k: e.block for k, e in self.ref.entries.items()}

    @invariant()
    def accounting_adds_up(self) -> None:
        self.kv.check()

    @invariant()
    def namespaces_share_no_blocks(self) -> None:
        owners: dict[int, set[str]] = {}
        for ns, _, b in self.cache.entries():
            owners.setdefault(b, set()).add(ns)
        assert all(len(v) == 1 for v in owners.values())


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_a_partial_leaf_beside_a_full_block_that_starts_with_its_tokens_can_be_evicted() -> None:
    """Hypothesis found this: a partial block [2] and, later, a full sibling block [2, 0, 0, 0] (locked
    by its request). The partial block is a leaf of its own, so eviction may take it; the reference had
    taken the sibling for its child and counted nothing removable."""
    machine = CacheMachine()
    steps: list[tuple[str, dict[str, Any]]] = [
        ("admit", {"budget": 1, "namespace": "", "seq": [2]}),
        ("admit", {"budget": 1, "namespace": "", "seq": [0]}),
        ("release", {"index": 1}),
        ("compute", {"index": 0, "n": 1}),
        ("admit", {"budget": 1, "namespace": "", "seq": [0]}),
        ("release", {"index": 0}),
        ("release", {"index": 0}),
        ("admit", {"budget": 1, "namespace": "", "seq": [2, 0, 0, 0]}),
        ("admit", {"budget": 1, "namespace": "", "seq": [2, 0]}),
        ("compute", {"index": 0, "n": 3}),
        ("release", {"index": 1}),
        ("evict", {"n": 1}),
    ]
    for name, args in steps:
        getattr(machine, name)(**args)
        machine.accounting_adds_up()
        machine.cache_holds_exactly_the_reference()
    assert machine._tree() == {("", (2, 0, 0, 0)): 1}


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
