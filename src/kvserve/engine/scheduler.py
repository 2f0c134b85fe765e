"""Scheduler: continuous batching with chunked prefill, prefix-cache admission and preemption.

Each step gets a token budget. Running decodes go first (one token each), then partly prefilled requests
take the next chunk of their prompt, oldest first. What is left of the budget admits waiting requests.
When KV blocks run out, the newest running request not yet scheduled in this step is preempted: its
computed blocks go to the prefix cache, its blocks are freed, and it waits at the head of the queue to be
recomputed (mostly from the cache). Requests are never failed for lack of memory once admitted.

Cache-aware order: among the first `_ORDERED_WINDOW` waiting requests, the one with the longest cached
prefix goes first (its blocks are hot and it costs least). Bound: a request passed over
`cache_aware_scheduling_bound` times goes before all others, in arrival order, so none waits forever.

Shared prefixes arriving together: a waiting request whose prompt shares more than a block with a
request still prefilling waits for that prefill, then finds the shared part in the cache instead of
computing it a second time.
"""

from collections import deque
from dataclasses import dataclass, field

from kvserve.cache.manager import KVCacheManager
from kvserve.cache.prefix_cache import MatchResult
from kvserve.config import EngineConfig
from kvserve.engine.request import Request, RequestStatus
from kvserve.model.runner import ForwardBatch, SequenceChunk

_ORDERED_WINDOW = 128


@dataclass
class ScheduledStep:
    batch: ForwardBatch = field(default_factory=ForwardBatch)
    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int]] = field(default_factory=list)

    @property
    def sampled(self) -> list[Request]:
        """Requests whose next token this step samples, in the order of the runner's logits rows."""
        return self.decodes + [r for r, n in self.prefills if r.num_computed + n == r.num_tokens]

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


@dataclass
class SchedulerCounters:
    cache_queries: int = 0
    cache_hits: int = 0
    prefill_tokens_computed: int = 0
    preemptions: int = 0


def _common_prefix_len(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.block_size = kv.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.counters = SchedulerCounters()

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledStep:
        step = ScheduledStep()
        budget = self.config.max_num_batched_tokens
        preempted = False
        scheduled: set[str] = set()
        # Decodes first, so a long prefill never stalls the streams already running; oldest first within each.
        for request in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed > 1):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue
            n = min(request.num_tokens - request.num_computed, budget)
            while not self._grow(request, request.num_computed + n):
                victim = next((r for r in reversed(self.running) if r.request_id not in scheduled), request)
                self.preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                self._add_chunk(step, request, n)
                scheduled.add(request.request_id)
                budget -= n
        if not preempted:
            self._admit(step, budget)
        return step

    def _add_chunk(self, step: ScheduledStep, request: Request, n: int) -> None:
        start = request.num_computed
        tokens = request.token_ids[start : start + n]
        sample = start + n == request.num_tokens
        chunk = SequenceChunk(tokens, start, request.block_table, sample)
        if n == 1 and start > 0:
            step.batch.decodes.append(chunk)
            step.decodes.append(request)
        else:
            step.batch.prefills.append(chunk)
            step.prefills.append((request, n))

    def _grow(self, request: Request, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size) - len(request.block_table)
        if need <= 0:
            return True
        blocks = self.kv.allocate(need)
        if blocks is None:
            return False
        request.block_table += blocks
        return True

    def _waiting_order(self) -> list[tuple[Request, MatchResult]]:
        window = [self.waiting[i] for i in range(min(len(self.waiting), _ORDERED_WINDOW))]
        matched = [(r, self._match(r)) for r in window]
        if len(matched) > 1 and self.kv.prefix_cache is not None:
            bound = self.config.cache_aware_scheduling_bound

            def priority(item: tuple[Request, MatchResult]) -> tuple[int, int, int]:
                request, match = item
                if request.num_skips >= bound:
                    return (0, 0, request.arrival)
                return (1, -match.num_tokens, request.arrival)

            matched.sort(key=priority)
        return matched

    def _match(self, request: Request) -> MatchResult:
        # At least the last token is always computed: its logits give the next token.
        return self.kv.match(request.namespace, request.token_ids[: request.num_tokens - 1])

    def _admit(self, step: ScheduledStep, budget: int) -> None:
        if budget == 0 or not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return
        admitted: list[Request] = []
        for request, match in self._waiting_order():
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if self._waits_for_shared_prefill(request, match):
                continue
            n = min(request.num_tokens - match.num_tokens, budget)
            if not self._start(request, match, match.num_tokens + n):
                break
            if request.cow_source is not None:
                step.batch.block_copies.append((request.cow_source, request.block_table[len(match.blocks)]))
            self._add_chunk(step, request, n)
            budget -= n
            admitted.append(request)
        if admitted:
            last = max(r.arrival for r in admitted)
            for request in self.waiting:
                if request.arrival < last and request not in admitted:
                    request.num_skips += 1
            for request in admitted:
                self.waiting.remove(request)

    def _start(self, request: Request, match: MatchResult, num_tokens: int) -> bool:
        """Lock the matched prefix and allocate the rest of the first chunk.

        Returns False, holding nothing, if there is no room."""
        self.kv.lock(match.blocks)
        if match.partial_block is not None:
            self.kv.lock([match.partial_block])
        need = -(-num_tokens // self.block_size) - len(match.blocks)
        blocks = self.kv.allocate(need)
        if blocks is None:
            self.kv.free(match.blocks)
            if match.partial_block is not None:
                self.kv.free([match.partial_block])
            return False
        request.block_table = list(match.blocks) + blocks
        request.cow_source = match.partial_block
        request.num_computed = match.num_tokens
        request.num_cached_blocks = len(match.blocks)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = match.num_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self.counters.cache_queries += request.num_tokens
        self.counters.cache_hits += match.num_tokens
        return True

    def _waits_for_shared_prefill(self, request: Request, match: MatchResult) -> bool:
        if self.kv.prefix_cache is None:
            return False
        for other in self.running:
            if other.namespace != request.namespace or other.num_computed >= other.num_prompt_tokens:
                continue
            if request.token_ids[0] != other.token_ids[0]:
                continue
            shared = _common_prefix_len(request.token_ids, other.token_ids, other.num_prompt_tokens)
            if shared - max(match.num_tokens, other.num_computed) >= self.block_size:
                return True
        return False

    def after_step(self, step: ScheduledStep) -> None:
        """The step's KV is computed: advance progress and publish every newly full block to the cache."""
        for request in step.decodes:
            self._advance(request, 1)
        for request, n in step.prefills:
            self._advance(request, n)
            self.counters.prefill_tokens_computed += n

    def _advance(self, request: Request, n: int) -> None:
        request.num_computed += n
        if request.cow_source is not None:
            self.kv.free([request.cow_source])
            request.cow_source = None
        full = request.num_computed // self.block_size
        if full > request.num_cached_blocks:
            self.kv.cache(
                request.namespace, request.token_ids[: full * self.block_size], request.block_table[:full]
            )
            request.num_cached_blocks = full

    def _release(self, request: Request) -> None:
        """Cache the request's computed KV (partial last block included), then drop its references."""
        computed = request.num_computed
        if computed:
            blocks = request.block_table[: -(-computed // self.block_size)]
            self.kv.cache(request.namespace, request.token_ids[:computed], blocks)
        if request.cow_source is not None:
            self.kv.free([request.cow_source])
            request.cow_source = None
        self.kv.free(request.block_table)
        request.block_table = []
        request.num_computed = 0
        request.num_cached_blocks = 0

    def preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.counters.preemptions += 1

    def finish(self, request: Request) -> None:
        """Remove a request (finished or aborted) wherever it is; its blocks stay cached, unlocked."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._release(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
