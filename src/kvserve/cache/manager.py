"""KVCacheManager: the one owner of KV block accounting, composed of one object per concern.

Every block decision is made here: match-and-lock a cached prefix, allocate (evicting when short), grow,
copy on write, publish computed KV, release, evict, pin and unpin. The scheduler above only decides who
runs, in what order and with what token budget; it never touches a block id or a reference count.

The concerns, each in its module, each an object that does nothing when its feature is off:
- the references (BlockAccounts, accounting.py) over the pool and the prefix tree (PrefixCache, or
  NoPrefixCache when prefix caching is off);
- the sliding layers' own pool and its rules (SlidingPool, or NoSlidingPool: sliding_pool.py);
- the tiers below memory and their loads off the engine thread (TierLoads, or NoTiers: tier_loads.py):
  `start_load` hands the loader the run that would continue the match, the request waits, and
  `admit(..., load=job)` gives each block that arrived a fresh memory block, copies it there and
  inserts it into the tree as if it had just been computed;
- pins and retentions (Holds, holds.py; NoPins when pinning is off), whose references outlive requests;
- the recent prefixes each namespace computed (RecentPrefixes, recent_prefixes.py; NoRecentPrefixes
  without the prefix cache), which `explain` reads to say why an admission computed text its namespace
  had seen (cache_miss.py).
"""

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

# Admission, CacheUsage, NamespaceUsage and SequenceBlocks are part of the manager's API.
from kvserve.cache.accounting import Admission as Admission
from kvserve.cache.accounting import BlockAccounts
from kvserve.cache.accounting import CacheUsage as CacheUsage
from kvserve.cache.accounting import NamespaceUsage as NamespaceUsage

# RELEASED is part of the manager's API: a sequence's sliding entry that it let go.
from kvserve.cache.block_pool import RELEASED as RELEASED
from kvserve.cache.block_pool import BlockPool

# CacheConfig is part of the manager's API: what it is built from.
from kvserve.cache.cache_config import CacheConfig as CacheConfig
from kvserve.cache.cache_miss import CacheMiss, Losses, explain
from kvserve.cache.holds import Holds, pins_for
from kvserve.cache.loader import LoadJob
from kvserve.cache.lower_tiers import LowerTiers
from kvserve.cache.no_prefix_cache import NoPrefixCache

# Pin and PinRefused are part of the manager's API (pin() returns and raises them).
from kvserve.cache.pins import Pin as Pin
from kvserve.cache.pins import PinRefused as PinRefused
from kvserve.cache.prefix_cache import MatchResult, PrefixCache
from kvserve.cache.recent_prefixes import NoRecentPrefixes, RecentPrefixes
from kvserve.cache.retention import Retention, Retentions
from kvserve.cache.sequence_blocks import SequenceBlocks as SequenceBlocks
from kvserve.cache.sequence_blocks import blocks_for
from kvserve.cache.state_pool import StatePool
from kvserve.cache.tier_loads import NoTiers, TierLoads
from kvserve.cache.tier_states import FoundState
from kvserve.cache.tiers import TIER_MEMORY, Arrived


class KVCacheManager:
    """Invariants (`check` verifies them; each is stated where it is kept):
    - The references: BlockAccounts (every block's count equals its holders; free + held = the pool;
      a block with several holders is a tree block).
    - A sequence's matched prefix is locked in the same call that finds it, before any allocation can
      evict: a match is never used stale.
    - Only computed KV is published, and a published block is never written again (copy on write).
    - Pins and retentions: Holds (their references, their caps, retained blocks are the tree's).
    - The sliding pool: SlidingPool (a sequence's sliding blocks are released exactly before its
      window; a sequence admitted with a cached prefix holds its window's sliding blocks, locked in the
      same call that found them; a tree node of a running sequence's window is never a tombstone).
    - A block loaded from a lower tier is verified there first and is written before it joins the tree;
      the loader holds host tensors only (TierLoads).
    - A hybrid model's state slots (StatePool, state_pool.py): each is free, one running sequence's
      live state, one draft's snapshot (in the checkpoints' share), or one checkpoint (in the tree at
      the node holding its last token, or pending on its sequence until that block joins the tree). A
      live state always holds the state after the sequence's `num_computed` tokens once the logged
      copies have run. A checkpoint at P holds the state after exactly the tree's first P tokens of its
      path: it is made only from a live state at P, and leaves with its node. An admission's match ends
      at a checkpoint (`MatchResult.checkpoint`): the KV matched past it is recomputed and counted
      (`Admission.recomputed`). A checkpoint that joins the tree is offered to the lower tiers, and one
      read from them joins the tree (a slot written whole from verified bytes) before the match.
    """

    def __init__(
        self,
        config: CacheConfig,
        lower: LowerTiers | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lower is not None and not config.enable_prefix_caching:
            raise ValueError("lower cache tiers need the prefix cache")
        if not 0 <= config.max_pinned_blocks < config.num_blocks:
            raise ValueError("the pinned blocks must leave at least one block of the pool unpinned")
        bs = self.block_size = config.block_size
        self.pool = BlockPool(config.num_blocks)
        self.sliding = config.sliding()
        self.states = config.states()
        self.prefix_cache = (
            PrefixCache(self.pool, bs, self.sliding, self.states)
            if config.enable_prefix_caching
            else NoPrefixCache()
        )
        # A hybrid model's checkpoints lost: skipped for want of a slot (every checkpoint slot pending on a
        # running sequence), or matches given up to whole blocks (a pool too full for a partial copy).
        self.checkpoint_misses = 0
        self.max_pinned_blocks = config.max_pinned_blocks
        self.clock = clock
        retained = config.max_retained_blocks if config.enable_prefix_caching else 0
        retentions = Retentions(self.pool, retained, config.max_retained_blocks_per_namespace, bs)
        self.accounts = BlockAccounts(self.pool, bs, self.prefix_cache, self.sliding, retentions.give_way)
        pins = pins_for(self.accounts, config.max_pinned_blocks, config.max_pinned_blocks_per_namespace)
        self.holds = Holds(self.accounts, pins, retentions)
        self.tiers = TierLoads(lower, self.accounts, config.load_budget_s) if lower is not None else NoTiers()
        self.recent = RecentPrefixes(bs) if config.enable_prefix_caching else NoRecentPrefixes()

    # Loads from the lower tiers.

    def cached_prefix_len(self, namespace: str, tokens: Sequence[int]) -> int:
        """How many leading tokens the cache holds now (a hint for ordering; nothing is locked)."""
        checkpointed = self.states.enabled
        return self.prefix_cache.match(
            namespace, tokens, record_hit=False, checkpointed=checkpointed
        ).num_tokens

    def start_load(
        self, namespace: str, tokens: Sequence[int], max_cached: int | None = None
    ) -> LoadJob | None:
        """Before admitting `tokens`: when a lower tier may continue their memory match by a block or
        more, start reading those blocks off the engine thread and return the job. The request then
        waits until `load_ready(job)`, and `admit(..., load=job)` copies what arrived into the pool.
        None when there is nothing to read: admit at once. Reads nothing here, locks nothing. A hybrid
        model's job also looks for a state checkpoint past memory's last one (tier_states.py), and is
        started where memory's KV alone reaches past that checkpoint too."""
        if not tokens:
            return None
        prompt = tokens[: self._cache_limit(tokens, max_cached)]
        # A hybrid model's job looks for a checkpoint past memory's last one too (tier_states.py).
        return self.tiers.start_load(namespace, prompt, states=self.states.enabled)

    def load_ready(self, job: LoadJob) -> bool:
        """Whether the job's blocks have arrived, or its budget is over (admit with what has)."""
        return self.tiers.ready(job)

    def restart_load(self, job: LoadJob) -> LoadJob | None:
        """A ready job whose blocks no longer continue the memory match (memory lost some of the match
        while they were read: evicted by other admissions) is read again from what memory still holds,
        within the same budget; the new job, or None when `job` is fine to admit with (or its budget is
        over)."""
        return self.tiers.restart_load(job)

    def cancel_load(self, job: LoadJob) -> None:
        """The request waiting for `job` left: drop what was read for it."""
        self.tiers.cancel(job)

    @property
    def loads_pending(self) -> int:
        """Loads started and not yet admitted or cancelled: a step with nothing to run waits for them."""
        return self.tiers.pending

    def wait_for_loads(self, timeout_s: float) -> None:
        """Return once a load is ready to admit (at once if one is), or after `timeout_s`."""
        self.tiers.wait(timeout_s)

    @staticmethod
    def _cache_limit(tokens: Sequence[int], max_cached: int | None) -> int:
        return len(tokens) - 1 if max_cached is None else min(len(tokens) - 1, max_cached)

    # A sequence's life: admit, grow, publish, release.

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
        accounts, bs = self.accounts, self.block_size
        found = self.tiers.take_state(load)
        arrived = self.tiers.take(load)
        seq = SequenceBlocks(namespace)
        prompt = tokens[: self._cache_limit(tokens, max_cached)]
        states = self.states.enabled
        if states and load is not None:
            hits = self._land_hybrid(seq, prompt, arrived, found, load)
            match = self.prefix_cache.match(namespace, prompt, checkpointed=True)
            accounts.hold(seq, match)
            hits = self._cut_hits(hits, match.num_tokens)
        else:
            match = self.prefix_cache.match(namespace, prompt, checkpointed=states)
            accounts.hold(seq, match)
            hits = {TIER_MEMORY: match.num_tokens}
            if self.tiers.land(seq, prompt, arrived, hits, load):
                # The loaded blocks are new leaves: nothing in memory continues them.
                match = MatchResult(tuple(seq.blocks), len(seq.blocks) * bs)
        if match.partial_block is not None:
            accounts.hold_copy_source(seq, match)
            n = min(len(tokens) - match.num_tokens, budget)
            if accounts.extend(seq, match.num_tokens + n):
                return self._live(accounts.admitted(seq, match.num_tokens, n, hits), match)
            # The copy source is one block more than the chunk itself needs; in a pool that can hold
            # the chunk but not both, give up the partial hit rather than never admitting.
            accounts.drop_copy_source(seq)
            hits[TIER_MEMORY] = len(match.blocks) * bs
            if self.sliding.enabled:
                # The whole blocks' window starts earlier, where a tombstone may lie: match again.
                accounts.release_all(seq)
                match = self.prefix_cache.match(namespace, prompt, record_hit=False, partial=False)
                accounts.hold(seq, match)
                hits[TIER_MEMORY] = match.num_tokens
            elif states:
                # Whole blocks only: the match ends at a checkpoint at a block's end, or is empty.
                self.checkpoint_misses += 1
                accounts.release_all(seq)
                match = self.prefix_cache.match(namespace, prompt, False, partial=False, checkpointed=True)
                accounts.hold(seq, match)
                hits[TIER_MEMORY] = match.num_tokens
        cached = len(seq.blocks) * bs
        n = min(len(tokens) - cached, budget)
        if accounts.extend(seq, cached + n):
            return self._live(accounts.admitted(seq, cached, n, hits), match)
        accounts.release_all(seq)
        return None

    def _land_hybrid(
        self,
        seq: SequenceBlocks,
        prompt: Sequence[int],
        arrived: Sequence[Arrived],
        found: FoundState | None,
        load: LoadJob,
    ) -> dict[str, int]:
        """A hybrid model's load: the blocks read join the tree after memory's whole blocks, and the
        checkpoint read, if newer than memory's last, joins it where the tree now holds its tokens, so
        that the match that follows ends there. Returns the tokens held by tier, memory's first."""
        tree, states = self.prefix_cache, self.states
        self.accounts.hold(seq, tree.match(seq.namespace, prompt, record_hit=False, partial=False))
        hits = {TIER_MEMORY: len(seq.blocks) * self.block_size}
        self.tiers.land(seq, prompt, arrived, hits, load)
        self.accounts.release_all(seq)
        mine = tree.match(seq.namespace, prompt, record_hit=False, checkpointed=True).num_tokens
        if found is None or found.position <= mine or not isinstance(states, StatePool):
            return hits
        slot = states.checkpoint()
        if slot is None and tree.evict_checkpoint():
            slot = states.checkpoint()
        if slot is None:
            self.checkpoint_misses += 1
            return hits
        if not self.tiers.write_state(slot, found, states) or not tree.add_checkpoint(
            seq.namespace, prompt[: found.position], slot
        ):
            states.free_checkpoint(slot)
        return hits

    @staticmethod
    def _cut_hits(hits: dict[str, int], cached: int) -> dict[str, int]:
        """`hits` (tokens by tier, in prompt order, memory's whole blocks first) cut to the first `cached`
        tokens; what is left (a partial block of memory's) is memory's."""
        out = {}
        for tier, n in hits.items():
            out[tier] = min(n, cached)
            cached -= out[tier]
        out[TIER_MEMORY] += cached
        return out

    def _live(self, admission: Admission, match: MatchResult) -> Admission:
        """A hybrid model's admission takes its live state slot, holding the match's checkpoint (zeros
        for an empty match), and counts the tokens matched past the checkpoint."""
        if not self.states.enabled:
            return admission
        assert isinstance(self.states, StatePool)
        seq = admission.seq
        seq.state_slot = self.states.live(match.checkpoint if admission.num_cached_tokens else None)
        return replace(
            admission, recomputed=match.recomputed + match.num_tokens - admission.num_cached_tokens
        )

    def explain(
        self,
        namespace: str,
        tokens: Sequence[int],
        admission: Admission,
        max_cached: int | None = None,
        load_timed_out: bool = False,
    ) -> CacheMiss | None:
        """Why `admission` (of `tokens`, the first) computed text `namespace` had seen lately, or None:
        no miss (cache_miss.py). `load_timed_out`: the blocks read for it ran out of time. Only the
        namespace's own index is read: another namespace's prompts are never seen here."""
        seen = self.recent.seen(namespace, tokens)
        cached, limit = admission.num_cached_tokens, self._cache_limit(tokens, max_cached)
        # Hashed again only for a loss: whether its first lost block was a retention's that ended.
        lost = min(seen.tokens, limit) // self.block_size > cached // self.block_size
        losses = Losses(
            admission.recomputed,
            load_timed_out,
            self.tiers.down(),
            lost and self.recent.expired(namespace, tokens, cached),
        )
        return explain(seen, limit, cached, self.block_size, losses)

    def grow(self, seq: SequenceBlocks, num_tokens: int, speculative: bool = False) -> bool:
        """Make `seq.blocks` cover `num_tokens` tokens; False, with nothing taken, if the pool cannot.

        A `speculative` growth is for draft rows (`roll_back` lets go of what their rejected tokens took,
        after the step): it may evict cached blocks as any growth does, but retained blocks never give
        way to it, since a draft is never the only way a request can run."""
        return self.accounts.extend(seq, num_tokens, speculative)

    def roll_back(self, seq: SequenceBlocks, num_tokens: int) -> None:
        """Let go of `seq`'s blocks past the first `num_tokens` tokens (the slots of a rejected draft:
        never a published block, since only computed tokens publish)."""
        keep = blocks_for(num_tokens, self.block_size)
        assert keep >= seq.num_published, "a roll back would drop a published block"
        if keep < len(seq.blocks):
            self.accounts.truncate(seq, keep)

    def sliding_table(self, seq: SequenceBlocks) -> list[int] | None:
        """The sequence's block table in the sliding layers' group, released entries as block 0 (never
        read: they lie before every window); None without a sliding pool (the global ids serve)."""
        return self.sliding.table(seq)

    def publish(self, seq: SequenceBlocks, tokens: Sequence[int], num_computed: int) -> None:
        """The KV of `tokens[:num_computed]` is computed: publish every newly full block, and let go of the
        copy source (the step that copied it has run)."""
        self.accounts.drop_copy_source(seq)
        full = num_computed // self.block_size
        if full > seq.num_published:
            sliding = self.sliding.entries(seq, full)
            self.prefix_cache.insert(
                seq.namespace, tokens[: full * self.block_size], seq.blocks[:full], sliding
            )
            self.tiers.offer(seq.keys, seq.namespace, tokens, seq.blocks[:full], seq.num_published, sliding)
            seq.num_published = full
            self._attach(seq, tokens, full * self.block_size)
        seq.num_computed = num_computed
        self.sliding.release_passed(seq, num_computed)

    def release(self, seq: SequenceBlocks, tokens: Sequence[int], num_computed: int) -> None:
        """The sequence ends (finished, aborted or preempted): its computed KV, a partial last block
        included, stays cached; every reference it held is dropped."""
        if seq.copy_source is not None:
            # Released before the step that copies: the block meant to receive the copy holds nothing,
            # and every full block before it came from the tree, so there is nothing to publish.
            self.accounts.drop_copy_source(seq)
        elif num_computed:
            n = blocks_for(num_computed, self.block_size)
            sliding = self.sliding.entries(seq, n)
            self.prefix_cache.insert(seq.namespace, tokens[:num_computed], seq.blocks[:n], sliding)
            # The state where the sequence stopped is the next turn's (or the resumed preemption's).
            self.checkpoint(seq, tokens, num_computed)
        self._release_states(seq, tokens, num_computed)
        if num_computed:
            self.recent.remember(seq.namespace, tokens[:num_computed])
        self.accounts.release_all(seq)
        seq.num_published = 0
        self.accounts.live.discard(seq)

    # A hybrid model's recurrent state (state_pool.py).

    def checkpoint(self, seq: SequenceBlocks, tokens: Sequence[int], position: int) -> None:
        """Keep the sequence's live state, the state after `tokens[:position]` (its `num_computed` as of
        the last step), as a checkpoint: in the tree where the node holding token position - 1 is there,
        else pending until it is. Takes a checkpoint slot, evicting the least valuable checkpoint when
        they hold all theirs; skipped (counted) when every one is pending."""
        states = self.states
        if not isinstance(states, StatePool) or seq.state_slot is None or not position:
            return
        if any(at == position for at, _ in seq.pending):
            return
        slot = states.checkpoint()
        if slot is None and self.prefix_cache.evict_checkpoint():
            slot = states.checkpoint()
        if slot is None:
            self.checkpoint_misses += 1
            return
        states.copy(seq.state_slot, slot)
        seq.pending.append((position, slot))
        self._attach(seq, tokens, min(position, seq.num_published * self.block_size))

    def _attach(self, seq: SequenceBlocks, tokens: Sequence[int], reach: int) -> None:
        """Move the sequence's pending checkpoints at or before `reach` (tokens the tree holds) into the
        tree; one the tree already has frees its slot."""
        if not seq.pending or not isinstance(self.states, StatePool):
            return
        left = []
        for position, slot in seq.pending:
            if position > reach:
                left.append((position, slot))
            elif not self.prefix_cache.add_checkpoint(seq.namespace, tokens[:position], slot):
                self.states.free_checkpoint(slot)
            else:
                self.tiers.offer_state(seq.keys, seq.namespace, tokens, position, slot, self.states)
        seq.pending = left

    def _release_states(self, seq: SequenceBlocks, tokens: Sequence[int], num_computed: int) -> None:
        states = self.states
        if not isinstance(states, StatePool):
            return
        self._attach(seq, tokens, num_computed)
        for _, slot in seq.pending:
            states.free_checkpoint(slot)
        seq.pending = []
        if seq.snapshot is not None:
            states.free_checkpoint(seq.snapshot)
        if seq.state_slot is not None:
            states.free(seq.state_slot)
        seq.state_slot = seq.snapshot = None

    def snapshot_state(self, seq: SequenceBlocks) -> bool:
        """Before a step verifies draft rows: keep the sequence's live state aside, so that a rejection
        can put it back (`restore_state`). The snapshot takes a checkpoint slot (evicting the least
        valuable checkpoint if need be): False, taking nothing, when there is none to take (no draft
        then). Always true for a model with no recurrent layers."""
        states = self.states
        if not isinstance(states, StatePool):
            return True
        assert seq.state_slot is not None and seq.snapshot is None
        slot = states.checkpoint()
        if slot is None and self.prefix_cache.evict_checkpoint():
            slot = states.checkpoint()
        if slot is None:
            return False
        states.copy(seq.state_slot, slot)
        seq.snapshot = slot
        return True

    def restore_state(self, seq: SequenceBlocks, keep: bool) -> None:
        """The draft's step is over: put the snapshot back as the live state unless `keep` (every draft
        token accepted), and free it."""
        states = self.states
        if not isinstance(states, StatePool) or seq.snapshot is None:
            return
        assert seq.state_slot is not None
        if not keep:
            states.copy(seq.snapshot, seq.state_slot)
        states.free_checkpoint(seq.snapshot)
        seq.snapshot = None

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The state copies decided since the last call, in order: the next step runs them first."""
        return self.states.take_copies()

    def reset_prefix_cache(self) -> int:
        return self.prefix_cache.reset()

    # Pins and retentions (holds.py).

    def pin(self, namespace: str, tokens: Sequence[int], ttl_s: float) -> Pin | None:
        """Hold the full blocks of `tokens` in memory for `ttl_s` seconds (with a sliding pool, and the
        sliding blocks of their last window, so that the prefix stays usable). A pin of the same prefix in
        the same namespace is extended instead. Returns None, holding nothing, when the prefix is not
        wholly cached (in memory or a lower tier): compute it, then pin again.

        Raises PinRefused when pinning is off, the prefix is shorter than a block, or the pinned blocks
        would exceed a cap.
        """
        return self.holds.pin(namespace, tokens, self.clock() + ttl_s, self._lock_cached)

    def _lock_cached(self, seq: SequenceBlocks, prefix: tuple[int, ...]) -> None:
        """Lock `prefix`'s cached blocks for `seq`, continuing memory's with a lower tier's read now (a
        pin: an engine call that answers with its blocks in memory)."""
        self.accounts.hold(seq, self.prefix_cache.match(seq.namespace, prefix))
        self.tiers.land(seq, prefix, self.tiers.read_now(seq.namespace, prefix, len(seq.blocks)), {})

    def unpin(self, namespace: str, pin_id: str) -> bool:
        """Let go of a pin of `namespace`; False if there is none by that id (or it is another's)."""
        return self.holds.pins.remove(namespace, pin_id) is not None

    def expire_pins(self) -> int:
        """Drop every pin whose time is over; its blocks stay cached, evictable. Returns how many."""
        return self.holds.pins.expire(self.clock())

    def pins(self, namespace: str) -> list[Pin]:
        return self.holds.pins.of(namespace)

    @property
    def retention_enabled(self) -> bool:
        return self.holds.retentions.enabled

    def retainable_length(self, num_tokens: int) -> int:
        """The most of a breakpoint's `num_tokens` tokens a retention could hold (0: retention off)."""
        return self.holds.retentions.retainable_length(num_tokens)

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
        return self.holds.retain(namespace, tokens, breakpoints, self.clock)

    def expire_retentions(self) -> int:
        """Drop every retention whose time is over; its blocks stay cached, evictable (and should they be
        evicted, a miss of them says `expired`)."""
        now = self.clock()
        for retention in self.holds.retentions.expired(now):
            self.recent.mark_expired(retention.namespace, retention.tokens)
        return self.holds.retentions.expire(now)

    def retentions(self, namespace: str) -> list[Retention]:
        return self.holds.retentions.of(namespace)

    # The whole.

    def usage(self) -> CacheUsage:
        """The pool by state without walking the tree (BlockAccounts.num_locked)."""
        cached = self.prefix_cache.num_nodes
        retentions = self.holds.retentions
        return CacheUsage(
            num_blocks=self.pool.num_blocks,
            num_free=self.pool.num_free,
            num_cached=cached,
            num_locked=self.accounts.num_locked(self.holds),
            num_evicted=self.prefix_cache.num_evicted,
            num_pinned=len(self.holds.pins.blocks()),
            num_evictable=cached - self.pool.num_shared,
            max_pinned=self.max_pinned_blocks,
            tiers=self.tiers.usage(),
            num_retained=retentions.num_blocks,
            max_retained=retentions.max_blocks,
            retentions_dropped=dict(retentions.dropped),
            retained_blocks_dropped=dict(retentions.dropped_blocks),
            num_state_checkpoints=self.prefix_cache.num_checkpoints,
            max_state_checkpoints=self.states.checkpoint_slots,
        )

    def namespace_usage(self, namespace: str) -> NamespaceUsage:
        pins, retentions = self.holds.pins, self.holds.retentions
        return NamespaceUsage(
            self.prefix_cache.num_nodes_in(namespace),
            len(pins.blocks_in(namespace)),
            pins.max_blocks_per_namespace,
            retentions.num_blocks_in(namespace),
            retentions.max_blocks_per_namespace,
        )

    def flush(self) -> None:
        """Wait until every load started is ready and the lower tiers have written every block offered
        so far (tests: what an admission finds is then a function of the workload alone)."""
        self.tiers.flush()

    def close(self) -> None:
        """Stop the loader, write what the lower tiers have queued and stop them."""
        self.tiers.close()

    def check(self) -> None:
        """Assert the class invariants (for tests and debugging: walks the whole tree)."""
        entries = self.accounts.check(self.holds, self.holds.pinned_sliding())
        self.holds.check(entries)
        if isinstance(self.states, StatePool):
            live = [seq.state_slot for seq in self.accounts.live if seq.state_slot is not None]
            assert len(live) == len(self.accounts.live), "a running sequence without a state"
            checkpoints = [slot for seq in self.accounts.live for _, slot in seq.pending]
            checkpoints += [seq.snapshot for seq in self.accounts.live if seq.snapshot is not None]
            if isinstance(self.prefix_cache, PrefixCache):
                self.prefix_cache.check_checkpoints()
                checkpoints += self.prefix_cache.checkpoint_slots()
            self.states.check(live, checkpoints)
