"""The cache layer on its own: a hypothesis state machine against an independent reference model."""

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.cache.block_pool import BlockPool
from kvserve.cache.manager import RELEASED, CacheConfig, KVCacheManager, SequenceBlocks
from kvserve.cache.prefix_cache import PrefixCache
from kvserve.cache.sliding_pool import SlidingPool

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
        self.kv = KVCacheManager(CacheConfig(NUM_BLOCKS, BS))
        cache = self.kv.prefix_cache
        assert isinstance(cache, PrefixCache)
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


class SlidingReference(Reference):
    """The reference with a sliding pool: each entry also has its sliding block or a tombstone (None),
    and a match is cut back to its longest usable prefix by the rule written here apart from the tree's:
    every entry that the next token's window reads (positions from P - window + 1 on) holds its sliding
    block."""

    def __init__(self, window: int) -> None:
        super().__init__()
        self.window = window
        self.sliding: dict[Key, int | None] = {}

    def first_read(self, num_tokens: int) -> int:
        return max(0, num_tokens - self.window + 1)

    def usable(
        self, namespace: str, query: Sequence[int], n: int, copied: int | None
    ) -> tuple[int, int | None]:
        path = [(namespace, tuple(query[: (j + 1) * BS])) for j in range(n // BS)]
        if copied is not None:
            path.append(next(k for k in self.entries if self.entries[k].block == copied))
        end = n
        while path:
            lo = self.first_read(end) // BS
            dead = [j for j in range(lo, len(path)) if self.sliding[path[j]] is None]
            if not dead:
                break
            del path[max(dead) :]
            end = len(path) * BS
        return end, copied if copied is not None and end == n else None

    def match(self, namespace: str, query: Sequence[int]) -> tuple[int, int | None]:
        n, copied = super().match(namespace, query)
        return self.usable(namespace, query, n, copied)

    def whole_match(self, namespace: str, query: Sequence[int]) -> int:
        """The usable match of whole blocks only (an admission that gave up its partial block)."""
        n, _ = super().match(namespace, query[: len(query) // BS * BS] if query else query)
        k = n // BS
        return self.usable(namespace, query, k * BS, None)[0]

    def insert_sliding(
        self,
        namespace: str,
        path: Sequence[int],
        blocks: Sequence[int],
        sliding: Sequence[int],
        locked: Counter[int],
    ) -> None:
        before = set(self.entries)
        self.insert(namespace, path, blocks, locked)
        for k in before - set(self.entries):
            del self.sliding[k]
        for j, s in enumerate(sliding[: len(blocks)]):
            key = (namespace, tuple(path[: (j + 1) * BS]))
            if key not in self.entries:
                continue
            if self.sliding.get(key) is None and s != RELEASED:
                self.sliding[key] = s
            else:
                self.sliding.setdefault(key, None)

    def old(self, key: Key) -> bool:
        """Whether no leaf below `key` reads it in its last window."""
        ns, p = key
        leaves = [q for n2, q in self.entries if n2 == ns and _under(q, p)]
        leaves = [q for q in leaves if not any(r != q and _under(r, q) for r in leaves)]
        return len(p) <= self.first_read(min(len(q) for q in leaves))


class SlidingCacheMachine(CacheMachine):
    """The same machine over a model with sliding layers: the manager has a sliding pool (tight, so
    that admissions and growth tombstone), drawn windows smaller than a block, equal to one and of
    several; the tree's sliding blocks and tombstones are checked against `SlidingReference`, matches
    against its usable-prefix rule, tombstoning against its order (old positions, then least recently
    used, then earlier positions), and global eviction takes tombstoned leaves first."""

    ref: SlidingReference

    @initialize(window=st.sampled_from([1, 2, 3, 4, 5, 8, 13]), extra=st.integers(0, 12))
    def start(self, window: int, extra: int) -> None:
        # Enough for one sequence's window and largest chunk (the factory's floor), and a few more.
        num_sliding = -(-(window + 3 * BS) // BS) + 3 + extra
        config = CacheConfig(NUM_BLOCKS, BS, num_sliding_blocks=num_sliding, sliding_window=window)
        self.kv = KVCacheManager(config)
        cache = self.kv.prefix_cache
        assert isinstance(cache, PrefixCache)
        self.cache = cache
        self.ref = SlidingReference(window)

    def _locked_sliding(self) -> Counter[int]:
        held: Counter[int] = Counter()
        for live in self.live:
            held.update(b for b in live.seq.sliding if b != RELEASED)
            if live.seq.sliding_copy_source is not None:
                held[live.seq.sliding_copy_source] += 1
        return held

    def _follow_tombstones(self, locked: Counter[int]) -> set[Key]:
        """Entries the cache tombstoned since the reference last looked: each was unlocked."""
        now = self.cache.sliding_entries()
        gone = {k for k, s in self.ref.sliding.items() if s is not None and k in now and now[k] is None}
        for key in gone:
            block = self.ref.sliding[key]
            assert block is not None and not locked[block], "a locked sliding block was tombstoned"
            self.ref.sliding[key] = None
        return gone

    def _follow(self, before: set[Key], locked: Counter[int], locked_sliding: Counter[int]) -> None:
        """After an admission or growth: what went was unlocked (the order is checked by the rules that
        evict alone, where one call decides it)."""
        gone = before - set(self._tree())
        for key in gone:
            assert not locked[self.ref.entries[key].block], "a locked block was evicted"
            del self.ref.entries[key]
            del self.ref.sliding[key]
        self._follow_tombstones(locked_sliding)

    @rule(namespace=namespaces, seq=tokens, budget=st.integers(1, 3 * BS))
    def admit(self, namespace: str, seq: list[int], budget: int) -> None:
        before = set(self.ref.entries)
        locked, locked_sliding = self._locked(), self._locked_sliding()
        expected, copied = self.ref.match(namespace, seq[:-1])
        admission = self.kv.admit(namespace, seq, budget)
        if admission is not None and admission.copy is None and copied is not None:
            # The partial hit was given up and the whole blocks matched again.
            expected, copied = self.ref.whole_match(namespace, seq[:-1]), None
        self._follow(before, locked, locked_sliding)
        if admission is None:
            return
        assert admission.num_cached_tokens == expected
        if admission.copy is not None:
            assert admission.copy[0] == copied
            assert admission.sliding_copy is not None
            assert (
                admission.sliding_copy[0]
                == self.ref.sliding[next(k for k in self.ref.entries if self.ref.entries[k].block == copied)]
            )
        assert admission.num_new_tokens == min(len(seq) - admission.num_cached_tokens, budget)
        self.live.append(_Live(admission.seq, seq, admission.num_cached_tokens))

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100), n=st.integers(1, 2 * BS))
    def compute(self, index: int, n: int) -> None:
        live = self.live[index % len(self.live)]
        target = min(live.computed + n, len(live.tokens))
        before = set(self.ref.entries)
        locked, locked_sliding = self._locked(), self._locked_sliding()
        grown = self.kv.grow(live.seq, target)
        self._follow(before, locked, locked_sliding)
        if not grown:
            return
        published = live.seq.num_published
        sliding = list(live.seq.sliding)
        live.computed = target
        self.kv.publish(live.seq, live.tokens, target)
        full = target // BS
        if full > published:
            self.ref.insert_sliding(
                live.seq.namespace, live.tokens[: full * BS], live.seq.blocks[:full], sliding, self._locked()
            )

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100))
    def release(self, index: int) -> None:
        live = self.live.pop(index % len(self.live))
        computed, blocks, sliding = live.computed, list(live.seq.blocks), list(live.seq.sliding)
        copying = live.seq.copy_source is not None
        self.kv.release(live.seq, live.tokens, computed)
        if computed and not copying:
            n = -(-computed // BS)
            self.ref.insert_sliding(
                live.seq.namespace, live.tokens[:computed], blocks[:n], sliding, self._locked()
            )

    @rule(n=st.integers(1, NUM_BLOCKS))
    def evict(self, n: int) -> None:
        before = set(self.ref.entries)
        locked = self._locked()
        removable = len(self.ref.removable(locked))
        freed = self.cache.evict(n)
        assert freed == min(n, removable)
        gone = before - set(self._tree())
        assert len(gone) == freed

        def key(k: Key) -> tuple[bool, int]:
            return (self.ref.sliding[k] is not None, self.ref.entries[k].last_use)

        survivors = self.ref.evictable_leaves(locked) - gone
        for k in gone:
            assert not locked[self.ref.entries[k].block], "a locked block was evicted"
        if gone and survivors:
            assert max(map(key, gone)) <= min(map(key, survivors)), "tombstoned leaves first, then LRU"
        for k in gone:
            del self.ref.entries[k]
            del self.ref.sliding[k]

    @rule(n=st.integers(1, 8))
    def evict_sliding(self, n: int) -> None:
        locked = self._locked_sliding()
        candidates = {k for k, s in self.ref.sliding.items() if s is not None and not locked[s]}
        order = {k: (not self.ref.old(k), self.ref.entries[k].last_use, len(k[1])) for k in candidates}
        freed = self.cache.evict_sliding(n)
        assert freed == min(n, len(candidates))
        gone = self._follow_tombstones(locked)
        assert len(gone) == freed
        left = candidates - gone
        if gone and left:
            assert max(order[k] for k in gone) <= min(order[k] for k in left), (
                "old positions first, then LRU, then earlier positions"
            )

    @invariant()
    def sliding_blocks_are_the_references(self) -> None:
        assert self.cache.sliding_entries() == self.ref.sliding


TestSlidingCacheMachine = SlidingCacheMachine.TestCase
TestSlidingCacheMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def _sliding_tree(window: int) -> tuple[PrefixCache, BlockPool, BlockPool]:
    pool, sliding = BlockPool(16), BlockPool(16)
    cache = PrefixCache(pool, BS, SlidingPool(sliding, window, BS))
    blocks, windows = pool.allocate(4), sliding.allocate(4)
    cache.insert("", list(range(4 * BS)), blocks, windows)
    for b in blocks:
        pool.release(b)
    for b in windows:
        sliding.release(b)
    return cache, pool, sliding


def test_tombstoning_takes_old_positions_before_the_last_window() -> None:
    """One path inserted at once (every node equally recent): the sliding blocks that no window of its
    end reads go first, so the whole prefix stays usable."""
    cache, _, sliding = _sliding_tree(window=BS)
    assert cache.evict_sliding(3) == 3
    assert sliding.num_used == 1
    assert cache.match("", [*range(4 * BS), 99]).num_tokens == 4 * BS


def test_a_match_past_a_tombstone_in_its_window_is_cut_back_to_it() -> None:
    cache, _, _ = _sliding_tree(window=2 * BS)
    assert cache.evict_sliding(2) == 2
    # Blocks 0 and 1 are tombstones: a prefix of 2 blocks needs block 1 (window 8 reads positions 1..7).
    assert cache.match("", [*range(2 * BS), 99]).num_tokens == 0
    match = cache.match("", [*range(4 * BS), 99])
    assert match.num_tokens == 4 * BS and match.sliding[:2] == (RELEASED, RELEASED)
