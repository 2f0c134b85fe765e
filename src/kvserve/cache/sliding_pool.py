"""The sliding pool: every rule of the sliding layers' own KV blocks, in one place.

A model with sliding-window layers (Gemma 3, Phi-3 small...) may keep those layers' KV in a second
block pool, far smaller than the global one: a sequence holds only the sliding blocks that its next
token's window reads and lets the others go. The PrefixCache, the KVCacheManager, the pins and the
tiers' landing call the rules here; the runner and the scheduler only see `table` (the block ids the
sliding layers read, `model/attention.KVCache`'s sliding group) and an Admission's `sliding_copy`.

The rules:
- The window: the token after `n` computed ones reads positions from `first_read(n)` on; the blocks
  wholly before it are passed, and a sequence releases them (`release_passed`), so a running sequence
  holds ceil(window / block_size) + 1 sliding blocks at most between steps, whatever its length.
- A sequence's `sliding` entries parallel its global `blocks`: RELEASED for the first `num_released`,
  each later one a reference to a sliding block (`hold`, `grow`, `truncate`, `let_go`).
- A cached prefix is usable only where the blocks its last window reads still hold their sliding
  blocks (`usable`): the tree cuts a match with it, the manager a run landed from a lower tier.
- When the pool is short, the tree frees sliding blocks only it holds, tombstoning their nodes, in
  `tombstone_order`: old positions first (those no leaf below reads in its last window), then least
  recently used, then, among equally recent ones, earlier positions.

`NoSlidingPool` is the same interface for a model whose sliding layers have no pool of their own (a
model without sliding layers, or one whose split would shrink the pool: its sliding layers share the
global ids): it holds nothing, releases nothing, and every prefix is usable.
(How the memory is split between the two pools is engine/factory.py's `_pools`.)
"""

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from kvserve.cache.block_pool import RELEASED, BlockPool
from kvserve.cache.sequence_blocks import SequenceBlocks

# A tree node as the check sees it: (namespace, tokens from the root through the node).
NodeKey = tuple[str, tuple[int, ...]]


class NoSlidingPool:
    """No sliding pool of its own: the sliding layers (if any) read the global block ids."""

    enabled = False

    def first_read(self, num_tokens: int) -> int:
        """The first position the token after `num_tokens` computed ones reads: every one."""
        return 0

    def usable(self, dead: Sequence[bool], num_tokens: int) -> int:
        """How many of a prefix's leading blocks are usable: all of them."""
        return len(dead)

    def window_blocks(self, sliding: Sequence[int | None], num_tokens: int) -> tuple[int, ...]:
        """The sliding blocks a match of `num_tokens` tokens locks: none."""
        return ()

    def entries(self, seq: SequenceBlocks, num_blocks: int) -> list[int] | None:
        """The sliding blocks of `seq`'s first `num_blocks` blocks, for the tree and the tiers (None: the
        global ids serve)."""
        return None

    def table(self, seq: SequenceBlocks) -> list[int] | None:
        """The sequence's block table in the sliding layers' group (None: the global one serves)."""
        return None

    def hold(self, seq: SequenceBlocks, window: Sequence[int]) -> None:
        """Lock a match's window (`MatchResult.sliding`) for `seq`."""

    def ref_all(self, blocks: Sequence[int]) -> None:
        """Take a reference to each of `blocks` (a pin's window: none without a pool)."""
        assert not blocks, "sliding blocks without a sliding pool"

    def release_all(self, blocks: Sequence[int]) -> None:
        """Drop a reference to each of `blocks`."""
        assert not blocks, "sliding blocks without a sliding pool"

    def only_tree_holds(self, block: int) -> bool:
        """Whether a tree node's sliding block is held by nothing else (so it may be tombstoned)."""
        raise AssertionError("a sliding block without a sliding pool")

    def tombstone_order(self, depth: int, lowest_leaf: int, last_access: int) -> tuple[bool, int, int]:
        """The key that orders the tree's unlocked sliding blocks for tombstoning, smallest first: a
        node ending at `depth` tokens, whose shallowest leaf below ends at `lowest_leaf`."""
        raise AssertionError("a sliding block without a sliding pool")

    def hold_copy_source(self, seq: SequenceBlocks, block: int | None) -> None:
        """Lock the sliding block of a partial match's block, which the next step copies."""

    def drop_copy_source(self, seq: SequenceBlocks) -> None:
        """Let go of the sliding copy source (the copy ran, or will not)."""

    def let_go(self, seq: SequenceBlocks) -> None:
        """Let go of every sliding block `seq` holds."""
        seq.sliding = []
        seq.num_released = 0

    def truncate(self, seq: SequenceBlocks, num_blocks: int) -> None:
        """Let go of `seq`'s sliding entries from `num_blocks` on."""

    def grow(self, seq: SequenceBlocks, need: int, evict: Callable[[int], int]) -> bool:
        """Give `seq` `need` more sliding blocks, tombstoning with `evict(n)` when short; False, taking
        none, if the pool cannot."""
        return True

    def release_passed(self, seq: SequenceBlocks, num_computed: int) -> None:
        """Let go of `seq`'s sliding blocks wholly before the next token's window."""

    def landing(self, seq: SequenceBlocks, first_read: int) -> int | None:
        """The sliding block for the block just added to `seq` by a landing run whose window starts at
        `first_read` (None: none, the block's sliding part is not kept)."""
        return None

    def keep_usable(self, seq: SequenceBlocks) -> int:
        """How many of `seq`'s blocks form a usable prefix, its passed entries released: all."""
        return len(seq.blocks)

    def free_blocks(self, num_free: int) -> int:
        """The blocks a step can take when the global pool has `num_free` free: as many."""
        return num_free

    def take(self, n: int) -> list[int] | None:
        """`n` fresh blocks outside any sequence (the step-cost probe), or None: none needed."""
        return None

    def give_back(self, blocks: Sequence[int] | None) -> None:
        """Return blocks of `take`, the last first (the free list then reads as before)."""

    def check(
        self,
        live: Iterable[SequenceBlocks],
        tree: dict[NodeKey, int | None],
        entries: Sequence[tuple[str, tuple[int, ...], int]],
        pinned: Iterable[int],
    ) -> None:
        """Assert the sliding invariants over the live sequences, the tree's nodes (`tree`: each node's
        sliding block; `entries`: each node's global block) and the pins' sliding blocks."""
        if any(seq.sliding or seq.sliding_copy_source is not None for seq in live):
            raise AssertionError("a sequence holds sliding blocks without a sliding pool")
        if any(b is not None for b in tree.values()):
            raise AssertionError("a tree node holds a sliding block without a sliding pool")


class SlidingPool(NoSlidingPool):
    """The sliding layers' own pool and the largest window of the model.

    Invariants (`check`, with the KVCacheManager's and the PrefixCache's):
    - Every sequence's `sliding` has one entry per entry of `blocks`; its first `num_released` entries
      are RELEASED and every later one holds one reference. Each sliding block's reference count
      equals its holders: the tree's node (one), each live sequence's held entry, each sequence copying
      from it (`sliding_copy_source`) and each pin that holds it.
    - At admission and after a publish of n computed tokens, the entries released are exactly those of
      the blocks wholly before position `first_read(n)`.
    - A tree node inside a running sequence's window is never a tombstone.
    """

    enabled = True

    def __init__(self, pool: BlockPool, window: int, block_size: int) -> None:
        if window < 1:
            raise ValueError("a sliding window is at least one token")
        self.pool = pool
        self.window = window
        self.block_size = block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_used(self) -> int:
        return self.pool.num_used

    def first_read(self, num_tokens: int) -> int:
        return max(0, num_tokens - self.window + 1)

    def usable(self, dead: Sequence[bool], num_tokens: int) -> int:
        """How many of a prefix's leading blocks form a usable prefix: `dead[j]` says block j lost its
        sliding block (a tombstone), `num_tokens` is what the blocks hold (the last may be partial).
        From the end back, a tombstone inside the window cuts the prefix to the blocks before it."""
        bs = self.block_size
        m, end = len(dead), num_tokens
        while m:
            lo = self.first_read(end) // bs
            cut = next((j for j in range(m - 1, lo - 1, -1) if dead[j]), None)
            if cut is None:
                break
            m, end = cut, cut * bs
        return m

    def window_blocks(self, sliding: Sequence[int | None], num_tokens: int) -> tuple[int, ...]:
        """The sliding blocks of a usable prefix's full blocks (`sliding`, in order) that the token after
        `num_tokens` reads, RELEASED before them."""
        lo = self.first_read(num_tokens) // self.block_size
        out = [RELEASED] * min(lo, len(sliding))
        for b in sliding[lo:]:
            assert b is not None, "a usable prefix has no tombstone in its window"
            out.append(b)
        return tuple(out)

    def entries(self, seq: SequenceBlocks, num_blocks: int) -> list[int] | None:
        return seq.sliding[:num_blocks]

    def table(self, seq: SequenceBlocks) -> list[int] | None:
        """Released entries read as block 0: they lie before every window, so no layer reads them."""
        return [0 if b == RELEASED else b for b in seq.sliding]

    def hold(self, seq: SequenceBlocks, window: Sequence[int]) -> None:
        seq.sliding = list(window)
        for b in seq.sliding:
            if b != RELEASED:
                self.pool.ref(b)
        seq.num_released = seq.sliding.count(RELEASED)

    def ref_all(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.pool.ref(b)

    def release_all(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.pool.release(b)

    def only_tree_holds(self, block: int) -> bool:
        return self.pool.ref_count(block) == 1

    def tombstone_order(self, depth: int, lowest_leaf: int, last_access: int) -> tuple[bool, int, int]:
        """Old positions (no leaf below reads them in its last window) first, least recently used first;
        a path published together is equally recent, and its earlier positions go first."""
        return (depth > self.first_read(lowest_leaf), last_access, depth)

    def hold_copy_source(self, seq: SequenceBlocks, block: int | None) -> None:
        assert block is not None, "a usable partial block keeps its sliding block"
        self.pool.ref(block)
        seq.sliding_copy_source = block

    def drop_copy_source(self, seq: SequenceBlocks) -> None:
        if seq.sliding_copy_source is not None:
            self.pool.release(seq.sliding_copy_source)
            seq.sliding_copy_source = None

    def let_go(self, seq: SequenceBlocks) -> None:
        for b in seq.sliding[seq.num_released :]:
            self.pool.release(b)
        super().let_go(seq)

    def truncate(self, seq: SequenceBlocks, num_blocks: int) -> None:
        for b in seq.sliding[num_blocks:]:
            if b != RELEASED:
                self.pool.release(b)
        del seq.sliding[num_blocks:]

    def grow(self, seq: SequenceBlocks, need: int, evict: Callable[[int], int]) -> bool:
        short = need - self.pool.num_free
        if short > 0:
            evict(short)
        if need > self.pool.num_free:
            return False
        seq.sliding += self.pool.allocate(need)
        return True

    def release_passed(self, seq: SequenceBlocks, num_computed: int) -> None:
        passed = self.first_read(num_computed) // self.block_size
        # A sequence never takes back what it let go: only a longer computed prefix releases more.
        for j in range(seq.num_released, passed):
            self.pool.release(seq.sliding[j])
            seq.sliding[j] = RELEASED
        seq.num_released = max(seq.num_released, passed)

    def landing(self, seq: SequenceBlocks, first_read: int) -> int | None:
        if len(seq.blocks) * self.block_size <= first_read:
            self.pool.release(seq.sliding[-1])
            seq.sliding[-1] = RELEASED
            return None
        return seq.sliding[-1]

    def keep_usable(self, seq: SequenceBlocks) -> int:
        """`usable` over the sequence's own entries (RELEASED: dead); the entries before the usable
        prefix's window are then released."""
        bs = self.block_size
        m = self.usable([b == RELEASED for b in seq.sliding[: len(seq.blocks)]], len(seq.blocks) * bs)
        lo = self.first_read(m * bs) // bs
        for j in range(min(lo, len(seq.sliding))):
            if seq.sliding[j] != RELEASED:
                self.pool.release(seq.sliding[j])
                seq.sliding[j] = RELEASED
        seq.num_released = min(lo, m)
        return m

    def free_blocks(self, num_free: int) -> int:
        return min(num_free, self.pool.num_free)

    def take(self, n: int) -> list[int] | None:
        return self.pool.allocate(n)

    def give_back(self, blocks: Sequence[int] | None) -> None:
        for block in reversed(blocks or ()):
            self.pool.release(block)

    def check(
        self,
        live: Iterable[SequenceBlocks],
        tree: dict[NodeKey, int | None],
        entries: Sequence[tuple[str, tuple[int, ...], int]],
        pinned: Iterable[int],
    ) -> None:
        held_by_tree = [b for b in tree.values() if b is not None]
        if len(set(held_by_tree)) != len(held_by_tree):
            raise AssertionError("two tree nodes hold one sliding block")
        holders: Counter[int] = Counter(held_by_tree)
        holders.update(pinned)
        sliding_of = {b: tree[(ns, path)] for ns, path, b in entries}
        for seq in live:
            if seq.sliding_copy_source is not None:
                holders[seq.sliding_copy_source] += 1
            for j in range(seq.num_released, seq.num_published):
                if seq.blocks[j] in sliding_of and sliding_of[seq.blocks[j]] is None:
                    raise AssertionError("a tombstone lies inside a running sequence's window")
            if len(seq.sliding) != len(seq.blocks):
                raise AssertionError("a sequence's sliding entries do not match its blocks")
            released, held = seq.sliding[: seq.num_released], seq.sliding[seq.num_released :]
            passed = self.first_read(seq.num_computed) // self.block_size
            if seq.num_released != passed or any(b != RELEASED for b in released) or RELEASED in held:
                raise AssertionError("a sequence's sliding blocks are not released exactly before its window")
            holders.update(held)
        for block in range(self.pool.num_blocks):
            if self.pool.ref_count(block) != holders[block]:
                raise AssertionError(f"sliding block {block}'s references are not its holders'")


# Stateless: one serves every user without a sliding pool.
NO_SLIDING_POOL = NoSlidingPool()
