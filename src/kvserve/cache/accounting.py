"""BlockAccounts: the pool's references, held by the live sequences, the tree, pins and retentions.

Every reference a sequence takes or drops goes through here: locking a match, copy on write's source,
growing (evicting when short), truncating and letting go. The KVCacheManager decides when; this module
keeps the counts right, and `check` walks them.
"""

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from kvserve.cache.block_pool import BlockPool
from kvserve.cache.no_prefix_cache import NoPrefixCache
from kvserve.cache.prefix_cache import MatchResult, PrefixCache
from kvserve.cache.sequence_blocks import SequenceBlocks, blocks_for
from kvserve.cache.sliding_pool import NoSlidingPool
from kvserve.cache.tiers import TierUsage


@dataclass(frozen=True)
class Admission:
    """A sequence admitted with its cached prefix locked and blocks for its first chunk allocated.

    `num_cached_tokens` tokens need no computing; the first chunk is the next `num_new_tokens`. When
    `copy` is set, the runner must copy block `copy[0]` into `copy[1]` before the step's forward pass (and
    `sliding_copy` likewise in the sliding group).
    `hits` splits the cached tokens by the tier they were found in.
    """

    seq: SequenceBlocks
    num_cached_tokens: int
    num_new_tokens: int
    copy: tuple[int, int] | None = None
    hits: dict[str, int] = field(default_factory=dict)
    # The same copy in the sliding layers' group, where its ids are its own.
    sliding_copy: tuple[int, int] | None = None
    # A hybrid model's tokens that the KV cache held but that are recomputed, for want of a state
    # checkpoint nearer the match's end: their miss reason is `no_checkpoint` (cache_miss.py).
    recomputed: int = 0


@dataclass(frozen=True)
class CacheUsage:
    num_blocks: int
    num_free: int
    num_cached: int
    num_locked: int
    num_evicted: int
    num_pinned: int = 0
    max_pinned: int = 0
    tiers: tuple[TierUsage, ...] = ()
    # Cached blocks nothing holds but the tree: what eviction may take.
    num_evictable: int = 0
    num_retained: int = 0
    max_retained: int = 0
    # Retentions dropped whole before their time, and retained blocks given up (trimmed, or with their
    # retention), by reason (cache/retention.py: budget, server_cap, memory).
    retentions_dropped: dict[str, int] = field(default_factory=dict)
    retained_blocks_dropped: dict[str, int] = field(default_factory=dict)
    # A hybrid model's recurrent-state checkpoints in the tree, and the slots they may take.
    num_state_checkpoints: int = 0
    max_state_checkpoints: int = 0

    @property
    def usage(self) -> float:
        """Fraction of the pool held by running requests (cached but unlocked blocks count as free)."""
        return self.num_locked / self.num_blocks


@dataclass(frozen=True)
class NamespaceUsage:
    """One namespace's share of the pool: its cached blocks, its pinned blocks and its pinning cap, its
    retained blocks and its retention budget."""

    num_cached: int
    num_pinned: int
    max_pinned: int
    num_retained: int = 0
    max_retained: int = 0


class Holders(Protocol):
    """Holders of pool references besides the tree and the sequences (pins and retentions)."""

    def references(self) -> Counter[int]: ...


class BlockAccounts:
    """Invariants (`check` verifies them):
    - Every block's pool reference count equals the number of its holders: the tree's node (one), each
      live sequence whose block table has it, each live sequence copying from it, and each pin and
      retention that holds it.
    - A block is free exactly when nothing holds it, so free + held = the pool.
    - A block with several holders is a tree block (sequences share blocks only through the tree),
      which is what lets `num_locked` count locked blocks without walking the tree.
    """

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        tree: PrefixCache | NoPrefixCache,
        sliding: NoSlidingPool,
        give_way: Callable[[], bool],
    ) -> None:
        """`give_way()` lets retained blocks go, the last resort of an allocation (False: none left)."""
        self.pool = pool
        self.block_size = block_size
        self.tree = tree
        self.sliding = sliding
        self.give_way = give_way
        self.live: set[SequenceBlocks] = set()

    def hold(self, seq: SequenceBlocks, match: MatchResult) -> None:
        """Lock a match for `seq`: its global blocks, and the sliding blocks of its window."""
        seq.blocks = list(match.blocks)
        for b in seq.blocks:
            self.pool.ref(b)
        self.sliding.hold(seq, match.sliding)

    def hold_copy_source(self, seq: SequenceBlocks, match: MatchResult) -> None:
        """Lock the partial block of `match`, which the next step copies into `seq`'s next block."""
        assert match.partial_block is not None
        self.pool.ref(match.partial_block)
        seq.copy_source = match.partial_block
        self.sliding.hold_copy_source(seq, match.partial_sliding)

    def drop_copy_source(self, seq: SequenceBlocks) -> None:
        if seq.copy_source is not None:
            self.pool.release(seq.copy_source)
            seq.copy_source = None
        self.sliding.drop_copy_source(seq)

    def release_all(self, seq: SequenceBlocks) -> None:
        for b in seq.blocks:
            self.pool.release(b)
        self.sliding.let_go(seq)
        seq.blocks = []

    def truncate(self, seq: SequenceBlocks, num_blocks: int) -> None:
        """Let go of `seq`'s blocks from `num_blocks` on (those in the tree stay there)."""
        for b in seq.blocks[num_blocks:]:
            self.pool.release(b)
        del seq.blocks[num_blocks:]
        self.sliding.truncate(seq, num_blocks)

    def extend(self, seq: SequenceBlocks, num_tokens: int, speculative: bool = False) -> bool:
        """Make `seq.blocks` cover `num_tokens` tokens, evicting when short; False, taking nothing, if the
        pool cannot. Retained blocks give way only to a growth that is not `speculative`."""
        need = blocks_for(num_tokens, self.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        short = need - self.pool.num_free
        if short > 0:
            self.tree.evict(short)
            # Retained blocks are given up only when nothing else could free a block: no other sequence
            # holds any (a waiting admission, or the running request that would preempt itself). Every
            # request that passed validation then fits, as it would without retention.
            while need > self.pool.num_free and not speculative and self._alone(seq) and self.give_way():
                self.tree.evict(need - self.pool.num_free)
        if need > self.pool.num_free:
            return False
        if not self.sliding.grow(seq, need, self.tree.evict_sliding):
            return False
        seq.blocks += self.pool.allocate(need)
        return True

    def _alone(self, seq: SequenceBlocks) -> bool:
        """Whether no sequence but `seq` holds blocks (so none could free any by ending)."""
        return len(self.live) == (1 if seq in self.live else 0)

    def admitted(self, seq: SequenceBlocks, cached: int, n: int, hits: dict[str, int]) -> Admission:
        seq.num_published = cached // self.block_size
        seq.num_computed = cached
        self.live.add(seq)
        copy = sliding_copy = None
        if seq.copy_source is not None:
            copy = (seq.copy_source, seq.blocks[seq.num_published])
        if seq.sliding_copy_source is not None:
            sliding_copy = (seq.sliding_copy_source, seq.sliding[seq.num_published])
        return Admission(seq, cached, n, copy, {tier: n for tier, n in hits.items() if n}, sliding_copy)

    def num_locked(self, holders: Holders) -> int:
        """Blocks that a live sequence holds, without walking the tree: a block with two or more
        references is always a tree block, so the tree's unlocked blocks are its nodes minus the shared
        blocks; blocks held by no sequence but by `holders` are counted from those."""
        unlocked = self.tree.num_nodes - self.pool.num_shared
        held = sum(1 for b, k in holders.references().items() if self.pool.ref_count(b) == 1 + k)
        return self.pool.num_used - unlocked - held

    def check(
        self, holders: Holders, pinned_sliding: Iterable[int]
    ) -> list[tuple[str, tuple[int, ...], int]]:
        """Assert the invariants of the references (and the sliding pool's); returns the tree's entries
        (namespace, path, block) for the holders' own checks."""
        entries = self.tree.entries()
        tree_blocks = [b for _, _, b in entries]
        if len(set(tree_blocks)) != len(tree_blocks):
            raise AssertionError("one block holds two different token prefixes in the tree")
        for namespace, count in Counter(ns for ns, _, _ in entries).items():
            if self.tree.num_nodes_in(namespace) != count:
                raise AssertionError(f"namespace {namespace!r}'s block count drifted from the tree")
        counts: Counter[int] = Counter(tree_blocks)
        for seq in self.live:
            counts.update(seq.blocks)
            if seq.copy_source is not None:
                counts[seq.copy_source] += 1
        counts.update(holders.references())
        for block in range(self.pool.num_blocks):
            if self.pool.ref_count(block) != counts[block]:
                raise AssertionError(
                    f"block {block} has {self.pool.ref_count(block)} references but {counts[block]} holders"
                )
        if self.pool.num_free + len(counts) != self.pool.num_blocks:
            raise AssertionError("free and held blocks do not add up to the pool")
        shared = {b for b in counts if counts[b] >= 2}
        if self.pool.num_shared != len(shared) or not shared <= set(tree_blocks):
            raise AssertionError("a block with several references is not a tree block, or the count drifted")
        locked = {b for seq in self.live for b in seq.blocks}
        locked.update(seq.copy_source for seq in self.live if seq.copy_source is not None)
        if (self.num_locked(holders), self.tree.num_nodes) != (len(locked), len(tree_blocks)):
            raise AssertionError(f"the counts disagree with the walk: {len(locked)} locked")
        self.sliding.check(self.live, self.tree.sliding_entries(), entries, pinned_sliding)
        return entries
