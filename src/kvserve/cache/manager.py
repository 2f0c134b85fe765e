"""KVCacheManager: the one owner of KV block accounting.

Every block decision is made here: match-and-lock a cached prefix, allocate (evicting when short), grow,
copy on write, publish computed KV, release, evict, pin and unpin. The scheduler above only decides who
runs, in what order and with what token budget; it never touches a block id or a reference count.

The tiers below memory (disk, Redis) own their reads (LowerTiers, lower_tiers.py): the manager offers
them every newly published full block, and lets them continue an admission's memory match. The reads
run off the engine thread (BlockLoader, loader.py): `start_load` hands the loader the run that would
continue the match, the request waits, and `admit(..., load=job)` gives each block that arrived a fresh
memory block, copies it there and inserts it into the tree as if it had just been computed.
Pins (pins.py) own their references like the tree's nodes: the manager locks the prefix a pin holds.
Retentions (retention.py) own theirs the same way: a breakpoint's cached prefix, held until its TTL
within budgets that drop old retentions, and given way when an allocation could not succeed otherwise.
"""

import operator
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

# RELEASED is part of the manager's API: a sequence's sliding entry that it let go.
from kvserve.cache.block_pool import RELEASED as RELEASED
from kvserve.cache.block_pool import BlockPool
from kvserve.cache.loader import LOAD_BUDGET_S, BlockLoader, LoadJob
from kvserve.cache.lower_tiers import LowerTiers

# Pin and PinRefused are part of the manager's API (pin() returns and raises them).
from kvserve.cache.pins import Pin as Pin
from kvserve.cache.pins import PinRefused as PinRefused
from kvserve.cache.pins import Pins
from kvserve.cache.prefix_cache import MatchResult, PrefixCache
from kvserve.cache.retention import Retention, Retentions, retention_ttl
from kvserve.cache.tiers import TIER_MEMORY, Arrived, TierUsage


@dataclass(eq=False)
class SequenceBlocks:
    """One sequence's hold on KV memory; only the KVCacheManager changes it.

    `blocks[j]` holds the sequence's tokens [j * block_size, (j + 1) * block_size), and the sequence owns
    one pool reference to each. The first `num_published` blocks are full and findable in the prefix
    cache. While `copy_source` is set, the sequence also holds a reference to that cached block: its first
    tokens are being copied into `blocks[num_published]` (copy on write) by the step that runs next.
    """

    namespace: str
    blocks: list[int] = field(default_factory=list)
    num_published: int = 0
    copy_source: int | None = None
    # Chain keys of the first full blocks, computed as far as needed (only with lower tiers).
    keys: list[bytes] = field(default_factory=list)
    # With a sliding pool of its own: `sliding[j]` is the sliding layers' block of the positions of
    # `blocks[j]`, RELEASED for the first `num_released` (wholly before the next token's window).
    sliding: list[int] = field(default_factory=list)
    num_released: int = 0
    # The tokens computed as of admission or the last `publish` (what the sliding release is measured
    # against).
    num_computed: int = 0
    # The sliding block of `copy_source`, copied alike into `sliding[num_published]`.
    sliding_copy_source: int | None = None


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


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Invariants (`check` verifies them):
    - Every block's pool reference count equals the number of its holders: the prefix cache's node (one),
      each live sequence whose block table has it, and each live sequence copying from it.
    - A block is free exactly when nothing holds it, so free + held = the pool, and a block is never both
      free and reachable from a sequence or the tree.
    - A sequence's matched prefix is locked in the same call that finds it, before any allocation can
      evict: a match is never used stale.
    - Only computed KV is published, and a published block is never written again (copy on write).
    - A block with several holders is a tree block (sequences share blocks only through the tree), which
      is what lets `usage` count locked blocks without walking the tree.
    - A pin owns one reference to each of its blocks, so a pinned block is never evictable; the distinct
      pinned blocks never exceed `max_pinned_blocks`, nor those of one namespace (a tenant or shared
      group) `max_pinned_blocks_per_namespace` (the PinTable's caps, see cache/pins.py).
    - A retention owns one reference to each of its blocks, which are the tree's blocks of its prefix in
      its namespace; the retained blocks stay within the server's cap and each namespace's budget (the
      RetentionTable's rules, see cache/retention.py). Retention never makes an allocation fail: when
      nothing is free or evictable and no other sequence holds blocks, retentions give way.
    - A block loaded from a lower tier is verified there first and is written before it joins the tree.
    - The loader holds host tensors only: no pool block, no reference, no tree node is ever its.

    With a sliding pool (`sliding_window`: the model's largest window):
    - Every sequence's `sliding` has one entry per entry of `blocks`; its first `num_released` entries
      are RELEASED and every later one holds one reference to its sliding-pool block. Each sliding
      block's reference count equals its holders: the tree's node (one; see PrefixCache), each live
      sequence's held entry and each sequence copying from it (`sliding_copy_source`).
    - At admission and after `publish(seq, tokens, n)`, the entries released are exactly those of the
      blocks wholly before position n - window + 1, the first the next token reads: a running sequence
      holds ceil(window / block_size) + 1 sliding blocks at most between steps, whatever its length.
    - A sequence admitted with a cached prefix of P tokens holds the global blocks of [0, P) and the
      sliding blocks of its window, locked in the same call that found them; a tree node of a running
      sequence's window is never a tombstone.
    - A model without sliding layers has no sliding pool, and a sliding model whose split would shrink
      the pool has none either: their sliding layers share the global blocks' ids, exactly as one pool.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        lower: LowerTiers | None = None,
        max_pinned_blocks: int = 0,
        clock: Callable[[], float] = time.monotonic,
        max_pinned_blocks_per_namespace: int | None = None,
        load_budget_s: float = LOAD_BUDGET_S,
        num_sliding_blocks: int = 0,
        sliding_window: int | None = None,
        max_retained_blocks: int = 0,
        max_retained_blocks_per_namespace: int = 0,
    ) -> None:
        """`load_budget_s`: how long a request waits at most for blocks read from the lower tiers.
        `num_sliding_blocks` and `sliding_window` (both or neither): the sliding layers' own pool and
        the largest window, whose blocks a sequence releases once every window has passed them.
        `max_retained_blocks` and `max_retained_blocks_per_namespace`: what retentions may hold, in all
        and in one namespace (0: retention off; always off without the prefix cache)."""
        if lower is not None and not enable_prefix_caching:
            raise ValueError("lower cache tiers need the prefix cache")
        if (num_sliding_blocks > 0) != (sliding_window is not None):
            raise ValueError("a sliding pool needs its window")
        if not 0 <= max_pinned_blocks < num_blocks:
            raise ValueError("the pinned blocks must leave at least one block of the pool unpinned")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.sliding_pool = BlockPool(num_sliding_blocks) if num_sliding_blocks else None
        self.sliding_window = sliding_window
        self.prefix_cache = (
            PrefixCache(self.pool, block_size, self.sliding_pool, sliding_window)
            if enable_prefix_caching
            else None
        )
        self.lower = lower
        self.loader = BlockLoader(lower, budget_s=load_budget_s) if lower is not None else None
        self.max_pinned_blocks = max_pinned_blocks
        self.clock = clock
        self._live: set[SequenceBlocks] = set()
        self._pins = Pins(
            self.pool, max_pinned_blocks, max_pinned_blocks_per_namespace, block_size, self.sliding_pool
        )
        retained = max_retained_blocks if enable_prefix_caching else 0
        self._retentions = Retentions(self.pool, retained, max_retained_blocks_per_namespace, block_size)

    def cached_prefix_len(self, namespace: str, tokens: Sequence[int]) -> int:
        """How many leading tokens the cache holds now (a hint for ordering; nothing is locked)."""
        if self.prefix_cache is None:
            return 0
        return self.prefix_cache.match(namespace, tokens, record_hit=False).num_tokens

    def start_load(
        self, namespace: str, tokens: Sequence[int], max_cached: int | None = None
    ) -> LoadJob | None:
        """Before admitting `tokens`: when a lower tier may continue their memory match by a block or
        more, start reading those blocks off the engine thread and return the job. The request then
        waits until `load_ready(job)`, and `admit(..., load=job)` copies what arrived into the pool.
        None when there is nothing to read: admit at once. Reads nothing here, locks nothing."""
        if self.loader is None or self.lower is None or self.prefix_cache is None or not tokens:
            return None
        prompt = tokens[: self._cache_limit(tokens, max_cached)]
        start = len(self.prefix_cache.match(namespace, prompt, record_hit=False).blocks)
        if not self.lower.may_continue(namespace, prompt, start):
            return None
        whole = len(prompt) // self.block_size * self.block_size
        return self.loader.submit(namespace, tuple(prompt[:whole]), start)

    def load_ready(self, job: LoadJob) -> bool:
        """Whether the job's blocks have arrived, or its budget is over (admit with what has)."""
        return BlockLoader.ready(job)

    def restart_load(self, job: LoadJob) -> LoadJob | None:
        """A ready job whose blocks no longer continue the memory match (memory lost some of the match
        while they were read: evicted by other admissions) is read again from what memory still holds,
        within the same budget; the new job, or None when `job` is fine to admit with (or its budget is
        over)."""
        if self.loader is None or self.prefix_cache is None:
            return None
        if job.deadline is None or time.monotonic() >= job.deadline:
            return None
        start = len(self.prefix_cache.match(job.namespace, job.tokens, record_hit=False).blocks)
        if start >= job.start:
            return None
        self.loader.cancel(job)
        return self.loader.submit(job.namespace, job.tokens, start, job.deadline)

    def cancel_load(self, job: LoadJob) -> None:
        """The request waiting for `job` left: drop what was read for it."""
        if self.loader is not None:
            self.loader.cancel(job)

    @property
    def loads_pending(self) -> int:
        """Loads started and not yet admitted or cancelled: a step with nothing to run waits for them."""
        return self.loader.pending if self.loader is not None else 0

    def wait_for_loads(self, timeout_s: float) -> None:
        """Return once a load is ready to admit (at once if one is), or after `timeout_s`."""
        if self.loader is not None:
            self.loader.wait(timeout_s)

    def _cache_limit(self, tokens: Sequence[int], max_cached: int | None) -> int:
        return len(tokens) - 1 if max_cached is None else min(len(tokens) - 1, max_cached)

    def admit(
        self,
        namespace: str,
        tokens: Sequence[int],
        budget: int,
        max_cached: int | None = None,
        load: LoadJob | None = None,
    ) -> Admission | None:
        """Lock the longest cached prefix of `tokens[:-1]` and allocate blocks for the first chunk, up to
        `budget` new tokens. The last token is always computed: its logits give the next token.
        `max_cached` caps the prefix used (a request that needs logits at cached positions). `load`, a
        job of `start_load` for these tokens, continues the memory match with the blocks it read, each
        copied into a fresh block; the job is over either way.

        Returns None, holding nothing, when the pool cannot hold the first chunk even after evicting.
        """
        if budget < 1 or not tokens:
            raise ValueError("admission needs a positive budget and at least one token")
        arrived = self.loader.take(load) if load is not None and self.loader is not None else []
        seq = SequenceBlocks(namespace)
        hits: dict[str, int] = {}
        if self.prefix_cache is not None:
            prompt = tokens[: self._cache_limit(tokens, max_cached)]
            match = self.prefix_cache.match(namespace, prompt)
            self._hold(seq, match)
            hits[TIER_MEMORY] = match.num_tokens
            landing = self._continuing(load, seq, prompt, arrived) if load is not None else []
            if self._land(seq, prompt, landing, hits):
                # The loaded blocks are new leaves: nothing in memory continues them.
                match = MatchResult(tuple(seq.blocks), len(seq.blocks) * self.block_size)
            cached = match.num_tokens
            if match.partial_block is not None:
                self._lock([match.partial_block])
                seq.copy_source = match.partial_block
                if self.sliding_pool is not None:
                    assert match.partial_sliding is not None
                    self.sliding_pool.ref(match.partial_sliding)
                    seq.sliding_copy_source = match.partial_sliding
                n = min(len(tokens) - cached, budget)
                if self._extend(seq, cached + n):
                    return self._admitted(seq, cached, n, hits)
                # The copy source is one block more than the chunk itself needs; in a pool that can
                # hold the chunk but not both, give up the partial hit rather than never admitting.
                self._drop_copy_source(seq)
                hits[TIER_MEMORY] = len(match.blocks) * self.block_size
                if self.sliding_pool is not None:
                    # The whole blocks' window starts earlier, where a tombstone may lie: match again.
                    self._release_all(seq)
                    match = self.prefix_cache.match(namespace, prompt, record_hit=False, partial=False)
                    self._hold(seq, match)
                    hits[TIER_MEMORY] = match.num_tokens
            cached = len(seq.blocks) * self.block_size
        else:
            cached = 0
        n = min(len(tokens) - cached, budget)
        if self._extend(seq, cached + n):
            return self._admitted(seq, cached, n, hits)
        self._release_all(seq)
        return None

    def _hold(self, seq: SequenceBlocks, match: MatchResult) -> None:
        """Lock a match for `seq`: its global blocks, and with a sliding pool the sliding blocks of its
        window (the entries before it are RELEASED)."""
        seq.blocks = list(match.blocks)
        self._lock(seq.blocks)
        if self.sliding_pool is not None:
            seq.sliding = list(match.sliding)
            for b in seq.sliding:
                if b != RELEASED:
                    self.sliding_pool.ref(b)
            seq.num_released = seq.sliding.count(RELEASED)

    def _release_all(self, seq: SequenceBlocks) -> None:
        self._release_blocks(seq.blocks)
        self._release_sliding(seq)
        seq.blocks = []

    def _drop_copy_source(self, seq: SequenceBlocks) -> None:
        if seq.copy_source is not None:
            self.pool.release(seq.copy_source)
            seq.copy_source = None
        if seq.sliding_copy_source is not None:
            assert self.sliding_pool is not None
            self.sliding_pool.release(seq.sliding_copy_source)
            seq.sliding_copy_source = None

    def _continuing(
        self, job: LoadJob, seq: SequenceBlocks, prompt: Sequence[int], arrived: list[Arrived]
    ) -> list[Arrived]:
        """The blocks of `arrived` (read for `job`) that continue `seq`'s memory match of `prompt`. Memory
        may have changed while they were read: blocks it holds now are skipped, and if it lost some
        before the job's first block, the loaded ones no longer continue it and are dropped."""
        skip = len(seq.blocks) - job.start
        if skip < 0 or job.namespace != seq.namespace or tuple(prompt[: len(job.tokens)]) != job.tokens:
            return []
        return arrived[skip:]

    def _land(
        self,
        seq: SequenceBlocks,
        tokens: Sequence[int],
        arrived: Sequence[Arrived],
        hits: dict[str, int],
    ) -> int:
        """Copy `arrived` (read from the lower tiers, continuing `seq`'s memory match of `tokens`) into
        fresh blocks of `seq` (evicting if needed); each joins the tree and stays locked for `seq`.
        With a sliding pool only the blocks of the run's last window get their sliding part (the
        others join the tree as tombstones), and the sequence keeps the longest usable prefix.
        Returns how many landed."""
        if self.lower is None or self.prefix_cache is None or not arrived:
            return 0
        cache, bs, start = self.prefix_cache, self.block_size, len(seq.blocks)
        first_read = cache.first_read((start + len(arrived)) * bs) if self.sliding_pool is not None else 0

        def fresh_block() -> tuple[int, int | None] | None:
            if not self._extend(seq, (len(seq.blocks) + 1) * bs):
                return None
            if self.sliding_pool is None:
                return seq.blocks[-1], None
            if len(seq.blocks) * bs <= first_read:
                self.sliding_pool.release(seq.sliding[-1])
                seq.sliding[-1] = RELEASED
                return seq.blocks[-1], None
            return seq.blocks[-1], seq.sliding[-1]

        def landed(block: int) -> None:
            sliding = seq.sliding if self.sliding_pool is not None else None
            cache.insert(seq.namespace, tokens[: len(seq.blocks) * bs], seq.blocks, sliding)

        loaded = self.lower.land(arrived, fresh_block, landed)
        # A block taken for a load that did not land holds nothing.
        self._truncate(seq, start + len(loaded.blocks))
        if self.sliding_pool is not None:
            self._truncate(seq, self._usable_blocks(seq))
        num_landed = max(0, len(seq.blocks) - start)
        for tier in loaded.tiers[:num_landed]:
            hits[tier] = hits.get(tier, 0) + bs
        if num_landed:
            hits[TIER_MEMORY] = start * bs
        return num_landed

    def _truncate(self, seq: SequenceBlocks, num_blocks: int) -> None:
        """Let go of `seq`'s blocks from `num_blocks` on (those in the tree stay there)."""
        self._release_blocks(seq.blocks[num_blocks:])
        del seq.blocks[num_blocks:]
        if self.sliding_pool is not None:
            for b in seq.sliding[num_blocks:]:
                if b != RELEASED:
                    self.sliding_pool.release(b)
            del seq.sliding[num_blocks:]

    def _usable_blocks(self, seq: SequenceBlocks) -> int:
        """How many of `seq`'s whole blocks form a usable prefix (the PrefixCache's rule over its own
        entries), its sliding entries then released exactly before that prefix's window."""
        assert self.prefix_cache is not None and self.sliding_pool is not None
        bs, m = self.block_size, len(seq.blocks)
        while m:
            lo = self.prefix_cache.first_read(m * bs) // bs
            dead = next((j for j in range(m - 1, lo - 1, -1) if seq.sliding[j] == RELEASED), None)
            if dead is None:
                break
            m = dead
        lo = self.prefix_cache.first_read(m * bs) // bs
        for j in range(min(lo, len(seq.sliding))):
            if seq.sliding[j] != RELEASED:
                self.sliding_pool.release(seq.sliding[j])
                seq.sliding[j] = RELEASED
        seq.num_released = min(lo, m)
        return m

    def _read_now(self, namespace: str, tokens: Sequence[int], start: int) -> list[Arrived]:
        """The blocks `start..` of `tokens` the lower tiers hold, read on this thread within the loader's
        budget (a pin: an engine call that answers with its blocks in memory)."""
        arrived: list[Arrived] = []
        if self.lower is None or self.loader is None:
            return arrived
        deadline = time.monotonic() + self.loader.budget_s

        def keep(tier: str, kv: torch.Tensor) -> bool:
            arrived.append((tier, kv))
            return True

        self.lower.read_run(namespace, tokens, start, lambda: time.monotonic() >= deadline, keep)
        return arrived

    def _admitted(self, seq: SequenceBlocks, cached: int, n: int, hits: dict[str, int]) -> Admission:
        seq.num_published = cached // self.block_size
        if self.sliding_pool is not None:
            seq.num_computed = cached
        self._live.add(seq)
        copy = sliding_copy = None
        if seq.copy_source is not None:
            copy = (seq.copy_source, seq.blocks[seq.num_published])
        if seq.sliding_copy_source is not None:
            sliding_copy = (seq.sliding_copy_source, seq.sliding[seq.num_published])
        return Admission(seq, cached, n, copy, {tier: n for tier, n in hits.items() if n}, sliding_copy)

    def grow(self, seq: SequenceBlocks, num_tokens: int, speculative: bool = False) -> bool:
        """Make `seq.blocks` cover `num_tokens` tokens; False, with nothing taken, if the pool cannot.

        A `speculative` growth is for draft rows (`roll_back` lets go of what their rejected tokens took,
        after the step): it may evict cached blocks as any growth does, but retained blocks never give
        way to it, since a draft is never the only way a request can run."""
        return self._extend(seq, num_tokens, speculative)

    def roll_back(self, seq: SequenceBlocks, num_tokens: int) -> None:
        """Let go of `seq`'s blocks past the first `num_tokens` tokens (the slots of a rejected draft:
        never a published block, since only computed tokens publish)."""
        keep = _blocks_for(num_tokens, self.block_size)
        assert keep >= seq.num_published, "a roll back would drop a published block"
        if keep < len(seq.blocks):
            self._truncate(seq, keep)

    def _extend(self, seq: SequenceBlocks, num_tokens: int, speculative: bool = False) -> bool:
        need = _blocks_for(num_tokens, self.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        short = need - self.pool.num_free
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(short)
            # Retained blocks are given up only when nothing else could free a block: no other sequence
            # holds any (a waiting admission, or the running request that would preempt itself). Every
            # request that passed validation then fits, as it would without retention.
            while (
                need > self.pool.num_free
                and not speculative
                and self._alone(seq)
                and self._retentions.give_way()
            ):
                self.prefix_cache.evict(need - self.pool.num_free)
        if need > self.pool.num_free:
            return False
        if self.sliding_pool is not None:
            short = need - self.sliding_pool.num_free
            if short > 0 and self.prefix_cache is not None:
                self.prefix_cache.evict_sliding(short)
            if need > self.sliding_pool.num_free:
                return False
            seq.sliding += self.sliding_pool.allocate(need)
        seq.blocks += self.pool.allocate(need)
        return True

    def _alone(self, seq: SequenceBlocks) -> bool:
        """Whether no sequence but `seq` holds blocks (so none could free any by ending)."""
        return len(self._live) == (1 if seq in self._live else 0)

    def sliding_table(self, seq: SequenceBlocks) -> list[int] | None:
        """The sequence's block table in the sliding layers' group, released entries as block 0 (never
        read: they lie before every window); None without a sliding pool (the global ids serve)."""
        if self.sliding_pool is None:
            return None
        return [0 if b == RELEASED else b for b in seq.sliding]

    def _release_passed(self, seq: SequenceBlocks, num_computed: int) -> None:
        """Let go of the sliding blocks wholly before the next token's window."""
        if self.sliding_pool is None or self.sliding_window is None:
            return
        seq.num_computed = num_computed
        first_read = max(0, num_computed - self.sliding_window + 1)
        # A sequence never takes back what it let go: only a longer computed prefix releases more.
        for j in range(seq.num_released, first_read // self.block_size):
            self.sliding_pool.release(seq.sliding[j])
            seq.sliding[j] = RELEASED
        seq.num_released = max(seq.num_released, first_read // self.block_size)

    def publish(self, seq: SequenceBlocks, tokens: Sequence[int], num_computed: int) -> None:
        """The KV of `tokens[:num_computed]` is computed: publish every newly full block, and let go of the
        copy source (the step that copied it has run)."""
        self._drop_copy_source(seq)
        full = num_computed // self.block_size
        if full > seq.num_published:
            sliding = seq.sliding[:full] if self.sliding_pool is not None else None
            if self.prefix_cache is not None:
                self.prefix_cache.insert(
                    seq.namespace, tokens[: full * self.block_size], seq.blocks[:full], sliding
                )
            if self.lower is not None:
                self.lower.offer(
                    seq.keys, seq.namespace, tokens, seq.blocks[:full], seq.num_published, sliding
                )
            seq.num_published = full
        self._release_passed(seq, num_computed)

    def release(self, seq: SequenceBlocks, tokens: Sequence[int], num_computed: int) -> None:
        """The sequence ends (finished, aborted or preempted): its computed KV, a partial last block
        included, stays cached; every reference it held is dropped."""
        if seq.copy_source is not None:
            # Released before the step that copies: the block meant to receive the copy holds nothing,
            # and every full block before it came from the tree, so there is nothing to publish.
            self._drop_copy_source(seq)
        elif self.prefix_cache is not None and num_computed:
            n = _blocks_for(num_computed, self.block_size)
            sliding = seq.sliding[:n] if self.sliding_pool is not None else None
            self.prefix_cache.insert(seq.namespace, tokens[:num_computed], seq.blocks[:n], sliding)
        self._release_blocks(seq.blocks)
        self._release_sliding(seq)
        seq.blocks = []
        seq.num_published = 0
        self._live.discard(seq)

    def _release_sliding(self, seq: SequenceBlocks) -> None:
        if self.sliding_pool is not None:
            for b in seq.sliding[seq.num_released :]:
                self.sliding_pool.release(b)
        seq.sliding = []
        seq.num_released = 0

    def _lock(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.pool.ref(b)

    def _release_blocks(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.pool.release(b)

    def reset_prefix_cache(self) -> int:
        return self.prefix_cache.reset() if self.prefix_cache is not None else 0

    def pin(self, namespace: str, tokens: Sequence[int], ttl_s: float) -> Pin | None:
        """Hold the full blocks of `tokens` in memory for `ttl_s` seconds (with a sliding pool, and the
        sliding blocks of their last window, so that the prefix stays usable). A pin of the same prefix in
        the same namespace is extended instead. Returns None, holding nothing, when the prefix is not
        wholly cached (in memory or a lower tier): compute it, then pin again.

        Raises PinRefused when pinning is off, the prefix is shorter than a block, or the pinned blocks
        would exceed a cap.
        """
        if self.prefix_cache is None or self.max_pinned_blocks == 0:
            raise PinRefused("pinning is off: start the server with --max-pinned-tokens")
        prefix = self._pins.pinnable_prefix(tokens)
        expires_at = self.clock() + ttl_s
        extended = self._pins.extend(namespace, prefix, expires_at)
        if extended is not None:
            return extended
        seq = SequenceBlocks(namespace)
        try:
            self._hold(seq, self.prefix_cache.match(namespace, prefix))
            self._land(seq, prefix, self._read_now(namespace, prefix, len(seq.blocks)), {})
            if len(seq.blocks) < len(prefix) // self.block_size:
                return None
            return self._pins.add(namespace, prefix, seq.blocks, expires_at, seq.sliding)
        finally:
            # A made pin holds references of its own; however the pin ends (made, not cached, refused,
            # or anything raising), the lock that found its blocks goes: a leak would shrink the pool.
            self._release_all(seq)

    def unpin(self, namespace: str, pin_id: str) -> bool:
        """Let go of a pin of `namespace`; False if there is none by that id (or it is another's)."""
        return self._pins.remove(namespace, pin_id) is not None

    def expire_pins(self) -> int:
        """Drop every pin whose time is over; its blocks stay cached, evictable. Returns how many."""
        return self._pins.expire(self.clock())

    def pins(self, namespace: str) -> list[Pin]:
        return self._pins.of(namespace)

    @property
    def retention_enabled(self) -> bool:
        return self._retentions.enabled

    def retainable_length(self, num_tokens: int) -> int:
        """The most of a breakpoint's `num_tokens` tokens a retention could hold (0: retention off)."""
        return self._retentions.retainable_length(num_tokens)

    def retain(
        self, namespace: str, tokens: Sequence[int], breakpoints: Sequence[tuple[int, float]]
    ) -> list[int]:
        """Hold the cached prefixes `tokens[:length]` of `namespace` against eviction for `ttl_s` seconds,
        for each breakpoint (length, ttl_s), after the rules of cache/retention.py; returns the tokens
        of each breakpoint's prefix that the namespace's retentions hold once all are made (0: none;
        what a request's usage reports as kept). Never raises for the breakpoints' values: one that is
        not an integer length in 1..len(tokens) with a positive TTL, or that holds less than a block,
        is skipped. Only what memory holds is retained (the lower tiers keep their own copies); a
        prefix cached in part is retained in part."""
        out = []
        for breakpoint in breakpoints:
            try:
                length, ttl_s = breakpoint
                length = operator.index(length)
            except (TypeError, ValueError):
                out.append(0)
                continue
            ttl = retention_ttl(ttl_s)
            if ttl is None or self.prefix_cache is None or not 0 < length <= len(tokens):
                out.append(0)
                continue
            prefix = self._retentions.retainable(tokens[:length])
            if not prefix:
                out.append(0)
                continue
            blocks = self.prefix_cache.match(namespace, prefix, record_hit=False).blocks
            # Nothing allocates between the match and the retention's references: no block of it can go.
            if blocks:
                held = prefix[: len(blocks) * self.block_size]
                self._retentions.retain(namespace, held, list(blocks), self.clock() + ttl)
            out.append(length)
        # A later breakpoint's retention may trim an earlier one's (the budget or the server cap).
        return [self._retentions.held(namespace, tokens[:n]) if n else 0 for n in out]

    def expire_retentions(self) -> int:
        """Drop every retention whose time is over; its blocks stay cached, evictable."""
        return self._retentions.expire(self.clock())

    def retentions(self, namespace: str) -> list[Retention]:
        return self._retentions.of(namespace)

    def usage(self) -> CacheUsage:
        """The pool by state without walking the tree: a block with two or more references is always a
        tree block (`check` asserts it), so the tree's unlocked blocks are its nodes minus the shared
        blocks; blocks that no request holds but pins or retentions do are counted from those (bounded by
        their caps)."""
        cached = self.prefix_cache.num_nodes if self.prefix_cache is not None else 0
        unlocked_cached = cached - self.pool.num_shared
        retentions = self._retentions
        return CacheUsage(
            num_blocks=self.pool.num_blocks,
            num_free=self.pool.num_free,
            num_cached=cached,
            num_locked=self.pool.num_used - unlocked_cached - self._held_without_requests(),
            num_evicted=self.prefix_cache.num_evicted if self.prefix_cache is not None else 0,
            num_pinned=len(self._pins.blocks()),
            num_evictable=unlocked_cached,
            max_pinned=self.max_pinned_blocks,
            tiers=tuple(self.lower.usage()) if self.lower is not None else (),
            num_retained=retentions.num_blocks,
            max_retained=retentions.max_blocks,
            retentions_dropped=dict(retentions.dropped),
            retained_blocks_dropped=dict(retentions.dropped_blocks),
        )

    def _held_without_requests(self) -> int:
        """Blocks that nothing but the tree, pins and retentions holds."""
        holds = self._pins.references() + self._retentions.references()
        return sum(1 for b, k in holds.items() if self.pool.ref_count(b) == 1 + k)

    def namespace_usage(self, namespace: str) -> NamespaceUsage:
        cached = self.prefix_cache.num_nodes_in(namespace) if self.prefix_cache is not None else 0
        pins, retentions = self._pins, self._retentions
        return NamespaceUsage(
            cached,
            len(pins.blocks_in(namespace)),
            pins.max_blocks_per_namespace,
            retentions.num_blocks_in(namespace),
            retentions.max_blocks_per_namespace,
        )

    def flush(self) -> None:
        """Wait until every load started is ready and the lower tiers have written every block offered
        so far (tests: what an admission finds is then a function of the workload alone)."""
        if self.loader is not None:
            self.loader.settle()
        if self.lower is not None:
            self.lower.flush()

    def close(self) -> None:
        """Stop the loader, write what the lower tiers have queued and stop them."""
        if self.loader is not None:
            self.loader.close()
        if self.lower is not None:
            self.lower.close()

    def check(self) -> None:
        """Assert the class invariants (for tests and debugging: walks the whole tree)."""
        holders: Counter[int] = Counter()
        tree_blocks: list[int] = []
        entries: list[tuple[str, tuple[int, ...], int]] = []
        if self.prefix_cache is not None:
            entries = self.prefix_cache.entries()
            tree_blocks = [b for _, _, b in entries]
            if len(set(tree_blocks)) != len(tree_blocks):
                raise AssertionError("one block holds two different token prefixes in the tree")
            for namespace, count in Counter(ns for ns, _, _ in entries).items():
                if self.prefix_cache.num_nodes_in(namespace) != count:
                    raise AssertionError(f"namespace {namespace!r}'s block count drifted from the tree")
        holders.update(tree_blocks)
        for seq in self._live:
            holders.update(seq.blocks)
            if seq.copy_source is not None:
                holders[seq.copy_source] += 1
        holders.update(self._pins.references())
        holders.update(self._retentions.references())
        for block in range(self.pool.num_blocks):
            if self.pool.ref_count(block) != holders[block]:
                raise AssertionError(
                    f"block {block} has {self.pool.ref_count(block)} references but {holders[block]} holders"
                )
        if self.pool.num_free + len(holders) != self.pool.num_blocks:
            raise AssertionError("free and held blocks do not add up to the pool")
        shared = {b for b in holders if holders[b] >= 2}
        if self.pool.num_shared != len(shared) or not shared <= set(tree_blocks):
            raise AssertionError("a block with several references is not a tree block, or the count drifted")
        self._pins.check()
        if any(self.pool.ref_count(b) < 2 for b in self._pins.blocks() & set(tree_blocks)):
            raise AssertionError("a pinned block is evictable")
        self._retentions.check()
        nodes = {(ns, path): b for ns, path, b in entries}
        bs = self.block_size
        for r in self._retentions.all():
            if any(nodes.get((r.namespace, r.tokens[: (j + 1) * bs])) != b for j, b in enumerate(r.blocks)):
                raise AssertionError("a retained block is not the tree's block of its prefix")
        locked = {b for seq in self._live for b in seq.blocks}
        locked.update(seq.copy_source for seq in self._live if seq.copy_source is not None)
        usage = self.usage()
        if (usage.num_locked, usage.num_cached) != (len(locked), len(tree_blocks)):
            raise AssertionError(f"usage {usage} disagrees with the walk: {len(locked)} locked")
        self._check_sliding()

    def _check_sliding(self) -> None:
        """The sliding pool's invariants (see the class and PrefixCache docstrings)."""
        pool = self.sliding_pool
        if pool is None:
            if any(seq.sliding or seq.sliding_copy_source is not None for seq in self._live):
                raise AssertionError("a sequence holds sliding blocks without a sliding pool")
            if self.prefix_cache is not None and any(self.prefix_cache.sliding_entries().values()):
                raise AssertionError("a tree node holds a sliding block without a sliding pool")
            return
        holders: Counter[int] = Counter()
        tree: dict[int, int | None] = {}
        if self.prefix_cache is not None:
            entries = self.prefix_cache.sliding_entries()
            held_by_tree = [b for b in entries.values() if b is not None]
            if len(set(held_by_tree)) != len(held_by_tree):
                raise AssertionError("two tree nodes hold one sliding block")
            holders.update(held_by_tree)
            tree = {b: entries[(ns, path)] for ns, path, b in self.prefix_cache.entries()}
        for pin in self._pins.all():
            holders.update(pin.sliding)
        for seq in self._live:
            if seq.sliding_copy_source is not None:
                holders[seq.sliding_copy_source] += 1
            for j in range(seq.num_released, seq.num_published):
                if seq.blocks[j] in tree and tree[seq.blocks[j]] is None:
                    raise AssertionError("a tombstone lies inside a running sequence's window")
            if len(seq.sliding) != len(seq.blocks):
                raise AssertionError("a sequence's sliding entries do not match its blocks")
            released, held = seq.sliding[: seq.num_released], seq.sliding[seq.num_released :]
            assert self.sliding_window is not None
            passed = max(0, seq.num_computed - self.sliding_window + 1) // self.block_size
            if seq.num_released != passed or any(b != RELEASED for b in released) or RELEASED in held:
                raise AssertionError("a sequence's sliding blocks are not released exactly before its window")
            holders.update(held)
        for block in range(pool.num_blocks):
            if pool.ref_count(block) != holders[block]:
                raise AssertionError(f"sliding block {block}'s references are not its holders'")
