"""Scheduler: continuous batching with chunked prefill, prefix-cache admission and preemption.

Each step gets a token budget. Running decodes go first (one token each), then partly prefilled requests
take the next chunk of their prompt, oldest first. What is left of the budget admits waiting requests.
When KV blocks run out, the newest running request not yet scheduled in this step is preempted: its
computed blocks go to the prefix cache, its blocks are freed, and it waits at the head of the queue to be
recomputed (mostly from the cache). Requests are never failed for lack of memory once admitted.

This is policy only: every block decision (match and lock, allocate, grow, copy on write, publish,
release) belongs to the KVCacheManager, which admits one request at a time so that no match is used
after another admission's eviction has changed the cache.

Cache-aware order: among a tenant's first waiting requests (`_ORDERED_WINDOW` of them, shared out
between the tenants waiting), the one with the longest cached prefix goes first (its blocks are hot and
it costs least). Bound: a request passed over `cache_aware_scheduling_bound` times by later requests of
its own tenant goes before the others of its tenant, in arrival order, so none waits forever.

Fairness between tenants: admission takes the tenants in turns, one request (one sequence: each of n
samples is a request) per tenant per turn, each tenant's requests in its cache-aware order. Tenants
holding fewer running slots than their share (max_num_seqs over the tenants present) take their turn
first, and among those alike the one admitted least recently. A tenant that queues a thousand sequences
thus delays another's next request by one admission per tenant, not by its whole backlog.

Blocks in the lower tiers (disk, Redis): a waiting request whose prompt a lower tier may continue past
its memory match starts a load when its turn comes (`KVCacheManager.start_load`) and stays waiting, in
its place, while the loader reads them off the engine thread; the step goes on for everyone else. A later
step admits it, in its turn, once its blocks have arrived or its load's budget is over, with what
arrived. Its turn still counts for its tenant only when it is admitted.

Speculation: once the step's decodes, prefill chunks and admissions are placed, what is left of the
budget goes to drafts, oldest decode first: the tokens a request's grammar forces where it has some,
else a `DraftSource`'s (engine/drafting.py's Drafter). A draft is extra rows of its sequence's decode,
at the positions after it, verified by the engine in the same step.
A draft takes blocks only where the pool has them without preempting anyone or taking a retained block,
and the blocks its rejected tokens took are let go of after the step (`after_step`).

Hybrid models (recurrent layers beside attention): a sequence's recurrent state is kept as a
checkpoint in the cache where a later request may resume: after the prompt's last token and the one
before it (n samples, a retry), at message ends and the positions the request names, where the cached
KV it recomputed for want of a checkpoint ends (a branch in the tree, which the next prompt branching
there will want), every `state_checkpoint_interval` tokens, and where it stops (the reply's end, a
preemption). A chunk never runs past such a position, so the state is there after the step that
reaches it. A draft never runs past one either; its sequence's state is snapshotted before the step,
and a rejection puts it back: the accepted tokens then run again as the next step's chunk (their KV
written again, the same tokens at the same positions, never into a published block), so the state is
always the one after `num_computed` tokens.

Shared prefixes arriving together: a waiting request whose prompt shares more than a block with a
request still prefilling waits for that prefill, then finds the shared part in the cache instead of
computing it a second time; likewise with a request loading it, instead of reading it a second time.
"""

import itertools
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from kvserve.cache.manager import KVCacheManager
from kvserve.config import EngineConfig
from kvserve.engine.request import Request, RequestStatus
from kvserve.model.recurrent import SCRATCH_SLOT
from kvserve.model.runner import ForwardBatch, SequenceChunk
from kvserve.sequences import common_prefix_len

_ORDERED_WINDOW = 128
# However many tenants wait, each has at least this many requests in the admission window.
_MIN_TENANT_WINDOW = 8


class DraftSource(Protocol):
    """Where decodes' drafts come from (engine/drafting.py, or a test's own)."""

    def propose(
        self, key: str, namespace: str, tokens: Sequence[int], limit: int, load: int, tenant: str
    ) -> list[int]:
        """At most `limit` tokens that may follow `tokens` (sequence `key`'s prompt and output so far) of
        `tenant` in cache namespace `namespace`, for a step of `load` rows so far; [] when a draft would
        not pay."""
        ...

    def verified(self, key: str, drafted: int, accepted: int) -> None:
        """The step verified `drafted` tokens of `key`'s last draft and accepted the first `accepted`."""
        ...

    def finished(self, key: str, namespace: str, output: Sequence[int], tenant: str) -> None:
        """Sequence `key` of `tenant` ended with `output` (its reply's tokens, empty when aborted)."""
        ...


@dataclass
class ScheduledStep:
    """One step's work. Each chunk's own `sample` flag is the one record of whether it samples.

    `drafts` maps a decoding request's id to the draft its decode verifies: one more decode row per
    draft token, at the positions after the decode's, each sampled (`batch` lays them out)."""

    decodes: list[tuple[Request, SequenceChunk]] = field(default_factory=list)
    prefills: list[tuple[Request, SequenceChunk]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    sliding_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: bool = False
    drafts: dict[str, list[int]] = field(default_factory=dict)
    # A hybrid model's state copies decided since the last step, run before this one's forward pass.
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def batch(self) -> ForwardBatch:
        decodes: list[SequenceChunk] = []
        for request, chunk in self.decodes:
            decodes.append(chunk)
            for j, token in enumerate(self.drafts.get(request.request_id, ()), 1):
                decodes.append(replace(chunk, token_ids=[token], start=chunk.start + j))
        return ForwardBatch(
            decodes=decodes,
            prefills=[c for _, c in self.prefills],
            block_copies=list(self.block_copies),
            sliding_copies=list(self.sliding_copies),
            state_copies=list(self.state_copies),
        )

    @property
    def num_tokens(self) -> int:
        drafted = sum(len(d) for d in self.drafts.values())
        return drafted + sum(len(c.token_ids) for _, c in (*self.decodes, *self.prefills))

    @property
    def sampled(self) -> list[Request]:
        """Requests whose next token this step samples, in the order of their logits rows: a request
        with a draft has 1 + len(draft) rows, one after another."""
        return [r for r, c in (*self.decodes, *self.prefills) if c.sample]

    def draft(self, request: Request) -> list[int]:
        return self.drafts.get(request.request_id, [])

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


@dataclass
class SchedulerCounters:
    cache_queries: int = 0
    cache_hits: int = 0
    # The hits split by the cache tier that held them (memory, disk).
    hits_by_tier: Counter[str] = field(default_factory=Counter)
    # Admissions that computed text their namespace had seen, by reason (cache/cache_miss.py).
    misses: Counter[str] = field(default_factory=Counter)
    prefill_tokens_computed: int = 0
    preemptions: int = 0
    # Admissions that waited for blocks read from a lower tier.
    loads: int = 0
    # Speculation: decodes that verified a draft, the draft tokens verified, and those accepted.
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # A hybrid model's prompt tokens the cache held but that were recomputed for want of a checkpoint.
    recomputed_tokens: int = 0


def _cache_limit(request: Request) -> int:
    """How many leading tokens of the request a cache hit may cover."""
    cap = request.max_cached_tokens
    return request.num_tokens - 1 if cap is None else min(cap, request.num_tokens - 1)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, drafter: DraftSource | None = None) -> None:
        """`drafter`: where the decodes' drafts come from (None: no speculation)."""
        self.config = config
        self.kv = kv
        self.drafter = drafter
        self.block_size = kv.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.counters = SchedulerCounters()
        self._waiting_by_tenant: Counter[str] = Counter()
        # Tenant -> when it last had a request admitted (a turn number): the least recent goes first.
        self._last_turn: dict[str, int] = {}
        self._turns = itertools.count()
        # A hybrid model with the prefix cache keeps state checkpoints (see the module docstring).
        self._checkpointing = kv.states.enabled and kv.prefix_cache.enabled

    def _stops(self, request: Request, after: int) -> list[int]:
        """Where the request's state should be checkpointed, past position `after` (the interval's next
        multiple only)."""
        if not self._checkpointing:
            return []
        p = request.num_prompt_tokens
        stops = [s for s in (p - 1, p, *request.checkpoints) if s > after]
        interval = self.config.state_checkpoint_interval
        if interval:
            stops.append((after // interval + 1) * interval)
        return stops

    def _room(self, request: Request, start: int, n: int) -> int:
        """`n` tokens from `start`, cut at the next checkpoint position."""
        return min([n, *(s - start for s in self._stops(request, start))])

    def _is_stop(self, request: Request, position: int) -> bool:
        return position in self._stops(request, position - 1)

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self._waiting_by_tenant[request.tenant] += 1

    def _left_waiting(self, request: Request) -> None:
        self._waiting_by_tenant[request.tenant] -= 1
        if not self._waiting_by_tenant[request.tenant]:
            del self._waiting_by_tenant[request.tenant]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        # Decodes first, so a long prefill never stalls the streams already running; oldest first within each.
        for request in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed > 1):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue
            assert request.kv is not None
            n = self._room(
                request, request.num_computed, min(request.num_tokens - request.num_computed, budget)
            )
            while not self.kv.grow(request.kv, request.num_computed + n):
                victim = next((r for r in reversed(self.running) if r.request_id not in scheduled), request)
                self.preempt(victim)
                step.preempted = True
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                self._add_chunk(step, request, n)
                scheduled.add(request.request_id)
                budget -= n
        # Admitting now would hand the blocks just freed to a newcomer instead of the preempted request.
        if not step.preempted:
            self._admit(step, budget)
            self._draft(step)
        if not step.empty:
            step.state_copies = self.kv.take_state_copies()
        return step

    def _draft(self, step: ScheduledStep) -> None:
        """Give the step's decodes their drafts, oldest first, within what is left of the budget."""
        drafter = self.drafter
        budget = self.config.max_num_batched_tokens - step.num_tokens
        if drafter is None or budget <= 0:
            return
        load = step.num_tokens
        for request, chunk in step.decodes:
            # The draft and the token sampled after it stay within max_tokens and the context.
            limit = min(
                self.config.speculative_tokens, budget, request.max_tokens - request.num_output_tokens - 1
            )
            if request.max_model_len is not None:
                limit = min(limit, request.max_model_len - request.num_tokens - 1)
            # Every draft row may be accepted: none may run past a checkpoint position (the decode's own
            # end included, chunk.start + 1).
            limit = min([limit, *(stop - chunk.start - 1 for stop in self._stops(request, chunk.start))])
            if limit <= 0:
                continue
            # Tokens the grammar forces are drafted first: they are all but certain to be kept.
            draft = request.grammar.forced(limit) if request.grammar is not None else []
            if not draft:
                draft = drafter.propose(
                    request.request_id, request.namespace, request.token_ids, limit, load, request.tenant
                )
                draft = draft[:limit]
                if request.grammar is not None:
                    draft = draft[: request.grammar.allowed_prefix(draft)]
            assert request.kv is not None
            # A hybrid model's state is snapshotted first (no draft where no slot is left for it).
            if not draft or not self.kv.snapshot_state(request.kv):
                continue
            if not self.kv.grow(request.kv, chunk.start + 1 + len(draft), speculative=True):
                self.kv.restore_state(request.kv, keep=True)
                continue
            # The draft rows share the decode's tables, which must cover their positions too.
            chunk.block_table = request.kv.blocks
            chunk.sliding_table = self.kv.sliding_table(request.kv)
            step.drafts[request.request_id] = draft
            budget -= len(draft)
            if budget == 0:
                break

    def _add_chunk(self, step: ScheduledStep, request: Request, n: int) -> None:
        assert request.kv is not None
        start = request.num_computed
        sample = start + n == request.num_tokens
        tokens = request.token_ids[start : start + n]
        slot = request.kv.state_slot
        chunk = SequenceChunk(
            tokens,
            start,
            request.kv.blocks,
            sample,
            request.needs_prompt_logits,
            self.kv.sliding_table(request.kv),
            SCRATCH_SLOT if slot is None else slot,
        )
        # The decode path is for one generated token after computed context; any other chunk is a prefill
        # chunk, a prompt's last token after a cache hit included: a prompt token runs as a prefill row
        # whether or not the rest of its prompt was cached, so a cache hit cannot change how the logits it
        # samples from are computed.
        if n == 1 and start >= request.num_prompt_tokens and sample:
            step.decodes.append((request, chunk))
        else:
            step.prefills.append((request, chunk))

    def _window(self) -> list[Request]:
        """The waiting requests admission considers: the first of each tenant, in queue order, the
        window shared out between the tenants so that one tenant's backlog cannot hide another."""
        tenants = len(self._waiting_by_tenant)
        if tenants <= 1:
            return [self.waiting[i] for i in range(min(len(self.waiting), _ORDERED_WINDOW))]
        quota = max(_MIN_TENANT_WINDOW, _ORDERED_WINDOW // tenants)
        wanted = sum(min(quota, k) for k in self._waiting_by_tenant.values())
        taken: Counter[str] = Counter()
        window = []
        for request in self.waiting:
            if taken[request.tenant] < quota:
                taken[request.tenant] += 1
                window.append(request)
                if len(window) == wanted:
                    break
        return window

    def _waiting_order(self) -> list[tuple[Request, int]]:
        """The admission window with each request's cached prefix length now (a hint: nothing is locked),
        in the order admission tries them: tenants in turns, each tenant's requests cache-aware."""
        kv = self.kv
        if not kv.prefix_cache.enabled:
            hinted = [(r, 0) for r in self._window()]
        else:
            hinted = [
                (r, kv.cached_prefix_len(r.namespace, r.token_ids[: _cache_limit(r)])) for r in self._window()
            ]
        bound = self.config.cache_aware_scheduling_bound

        def priority(item: tuple[Request, int]) -> tuple[int, int, int]:
            request, cached = item
            if request.num_skips >= bound:
                return (0, 0, request.arrival)
            return (1, -cached, request.arrival)

        by_tenant: dict[str, list[tuple[Request, int]]] = {}
        for item in hinted:
            by_tenant.setdefault(item[0].tenant, []).append(item)
        for items in by_tenant.values():
            items.sort(key=priority)
        if len(by_tenant) <= 1:
            return [item for items in by_tenant.values() for item in items]
        running = Counter(r.tenant for r in self.running)
        present = set(by_tenant) | set(running)
        share = -(-self.config.max_num_seqs // len(present))
        turns = sorted(by_tenant, key=lambda t: (running[t] >= share, self._last_turn.get(t, -1)))
        rounds = itertools.zip_longest(*(by_tenant[t] for t in turns))
        return [item for group in rounds for item in group if item is not None]

    def _admit(self, step: ScheduledStep, budget: int) -> None:
        if budget == 0 or not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return
        admitted: list[Request] = []
        order = self._waiting_order()
        # Loading requests this admission will consider: one of them brings a shared prefix for all.
        loading = [r for r, _ in order if r.load is not None]
        for request, cached_hint in order:
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if self._waits_for_shared_prefill(request, cached_hint):
                continue
            if request.load is None:
                if self._waits_for_shared_load(request, cached_hint, loading):
                    continue
                request.load = self.kv.start_load(
                    request.namespace, request.token_ids, request.max_cached_tokens
                )
                if request.load is not None:
                    self.counters.loads += 1
                    loading.append(request)
                    # Its blocks are read off the engine thread: the step goes on without it, and a
                    # later one admits it (never this one, so that a run replays alike).
                    continue
            if request.load is not None:
                if not self.kv.load_ready(request.load):
                    continue
                restarted = self.kv.restart_load(request.load)
                if restarted is not None:
                    request.load = restarted
                    continue
            # Match, lock and allocate in one call per request: an earlier admission's eviction may
            # have reused blocks that the hint above still points at.
            load_timed_out = request.load is not None and request.load.timed_out
            admission = self.kv.admit(
                request.namespace, request.token_ids, budget, request.max_cached_tokens, request.load
            )
            request.load = None
            if admission is None:
                break
            request.kv = admission.seq
            request.num_computed = admission.num_cached_tokens
            if request.num_cached_tokens is None:
                request.num_cached_tokens = admission.num_cached_tokens
                request.num_recomputed_tokens = admission.recomputed
                self.counters.recomputed_tokens += admission.recomputed
                if admission.recomputed:
                    # Where the cached KV ends, the tree branches: a checkpoint there serves the next
                    # prompt that branches off at the same point (a shared tools block, a system prompt).
                    branch = admission.num_cached_tokens + admission.recomputed
                    request.checkpoints = tuple(sorted({*request.checkpoints, branch}))
                request.cache_miss = self.kv.explain(
                    request.namespace, request.token_ids, admission, request.max_cached_tokens, load_timed_out
                )
                if request.cache_miss is not None:
                    self.counters.misses[request.cache_miss.reason] += 1
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.counters.cache_queries += request.num_tokens
            self.counters.cache_hits += admission.num_cached_tokens
            self.counters.hits_by_tier.update(admission.hits)
            if admission.copy is not None:
                step.block_copies.append(admission.copy)
            if admission.sliding_copy is not None:
                step.sliding_copies.append(admission.sliding_copy)
            n = self._room(request, admission.num_cached_tokens, admission.num_new_tokens)
            self._add_chunk(step, request, n)
            budget -= n
            admitted.append(request)
        if admitted:
            # Passed over counts only within a tenant: between tenants the turns bound the wait.
            last: dict[str, int] = {}
            for request in admitted:
                last[request.tenant] = max(last.get(request.tenant, -1), request.arrival)
                self._last_turn[request.tenant] = next(self._turns)
            ids = {r.request_id for r in admitted}
            for request in self.waiting:
                if request.arrival < last.get(request.tenant, -1) and request.request_id not in ids:
                    request.num_skips += 1
            for request in admitted:
                self.waiting.remove(request)
                self._left_waiting(request)
            self._forget_idle_tenants()

    def _forget_idle_tenants(self) -> None:
        """Drop the turns of tenants with nothing waiting or running, so the table stays as small as
        the tenants present (a tenant back from idle goes first: it holds nothing)."""
        if len(self._last_turn) > 2 * (len(self._waiting_by_tenant) + len(self.running)) + 64:
            present = {*self._waiting_by_tenant, *(r.tenant for r in self.running)}
            self._last_turn = {t: turn for t, turn in self._last_turn.items() if t in present}

    def _waits_for_shared_prefill(self, request: Request, cached: int) -> bool:
        # A request that needs the prompt's logits computes it whatever the cache holds.
        if not self.kv.prefix_cache.enabled or request.max_cached_tokens is not None:
            return False
        for other in self.running:
            if other.namespace != request.namespace or other.num_computed >= other.num_prompt_tokens:
                continue
            if request.token_ids[0] != other.token_ids[0]:
                continue
            shared = common_prefix_len(request.token_ids, other.token_ids, other.num_prompt_tokens)
            if shared - max(cached, other.num_computed) >= self.block_size:
                return True
        return False

    def _waits_for_shared_load(self, request: Request, cached: int, loading: list[Request]) -> bool:
        """Whether a request loading now (in this admission's order, so admitted in its turn) reads more
        than a block of `request`'s prompt past what memory holds: `request` then finds it in memory
        once that one is admitted, instead of reading it a second time (n samples of one prompt)."""
        if request.max_cached_tokens is not None:
            return False
        for other in loading:
            if other.load is None or other.namespace != request.namespace:
                continue
            if request.token_ids[0] != other.token_ids[0]:
                continue
            shared = common_prefix_len(request.token_ids, other.token_ids, other.num_prompt_tokens)
            if shared - cached >= self.block_size:
                return True
        return False

    def after_step(self, step: ScheduledStep, kept: dict[str, int] | None = None) -> None:
        """The step's KV is computed: advance progress and publish every newly full block to the cache.

        A decode that verified a draft advances by the rows it kept (`kept`: its accepted draft tokens
        and the decode's own), and the blocks only its rejected rows reached are let go of: nothing
        past the accepted tokens is ever published."""
        kept = kept or {}
        for request, chunk in (*step.decodes, *step.prefills):
            assert request.kv is not None
            draft = step.draft(request)
            rows = kept.get(request.request_id, 1) if draft else len(chunk.token_ids)
            # A hybrid model's state ran through every draft row: where one was rejected, it goes back to
            # the snapshot, and the rows kept run again (module docstring).
            rerun = bool(draft) and request.kv.state_slot is not None and rows < 1 + len(draft)
            if draft:
                self.kv.restore_state(request.kv, keep=not rerun)
            if not rerun:
                request.num_computed += rows
            self.kv.publish(request.kv, request.token_ids, request.num_computed)
            if not rerun and self._checkpointing and self._is_stop(request, request.num_computed):
                self.kv.checkpoint(request.kv, request.token_ids, request.num_computed)
            if draft:
                self.kv.roll_back(request.kv, request.num_computed + (rows if rerun else 0) + 1)
                self.counters.drafts += 1
                self.counters.draft_tokens += len(draft)
                self.counters.accepted_tokens += rows - 1
        self.counters.prefill_tokens_computed += sum(len(c.token_ids) for _, c in step.prefills)

    def _release(self, request: Request) -> None:
        """Cache the request's computed KV (partial last block included), then drop its references."""
        assert request.kv is not None
        self.kv.release(request.kv, request.token_ids, request.num_computed)
        request.kv = None
        request.num_computed = 0

    def preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self._waiting_by_tenant[request.tenant] += 1
        self.counters.preemptions += 1

    def finish(self, request: Request) -> None:
        """Remove a request (finished or aborted) wherever it is; its blocks stay cached, unlocked."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._release(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
            self._left_waiting(request)
            if request.load is not None:
                self.kv.cancel_load(request.load)
                request.load = None
        request.status = RequestStatus.FINISHED
