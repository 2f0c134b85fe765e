"""Engine: the synchronous step loop. add_request -> step() -> RequestDeltas, until every request ends."""

import itertools
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvserve.cache.manager import CacheUsage
from kvserve.cache.pins import Pin
from kvserve.config import EngineConfig
from kvserve.engine import sampler
from kvserve.engine.cost_probe import ProbeStep, probe_steps, warm_up_steps
from kvserve.engine.drafting import ROW_COST, Drafter
from kvserve.engine.factory import EngineParts, build_parts
from kvserve.engine.logprobs import TokenLogprob, token_logprobs
from kvserve.engine.masks import MaskWorker, StepMasks
from kvserve.engine.outputs import RequestDelta
from kvserve.engine.reply_memory import ReplyMemory
from kvserve.engine.request import DEFAULT_TENANT, Request
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.scheduler import ScheduledStep
from kvserve.engine.speculation import Taken, verify
from kvserve.engine.step_cost import LoadCostEstimator, RowShares, StepCosts
from kvserve.engine.text_stream import TextStream
from kvserve.engine.validation import CheckedPrompt, validate_request, validate_token_ids
from kvserve.errors import InvalidRequestError
from kvserve.model.loader import LoadedModel
from kvserve.model.runner import StepLogits

# How long a step with nothing to run but loads in flight waits for one of them.
LOAD_WAIT_S = 0.05


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    prompt_tokens: int
    generation_tokens: int
    cache_queries: int
    cache_hits: int
    hits_by_tier: dict[str, int]
    prefill_tokens_computed: int
    preemptions: int
    cache: CacheUsage
    # Speculation (vLLM's spec_decode counters): steps where a sequence verified a draft, the draft
    # tokens verified, and those accepted.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # What a step costs here, as measured (engine/step_cost.py); None where speculation is off.
    step_costs: StepCosts | None = None
    # A hybrid model's prompt tokens the cache held but that were recomputed for want of a state
    # checkpoint at or nearer the match's end.
    recomputed_tokens: int = 0
    # Admissions that computed text their namespace had seen, by reason (cache/cache_miss.py).
    misses_by_reason: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.cache_hits / self.cache_queries if self.cache_queries else 0.0

    @property
    def spec_acceptance_rate(self) -> float | None:
        """Accepted / draft tokens; None while nothing was drafted."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else None

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Accepted tokens per draft (vLLM's mean acceptance length is 1 + this); None without drafts."""
        return self.spec_accepted_tokens / self.spec_drafts if self.spec_drafts else None


class Engine:
    """The synchronous engine: requests in (`add_request`), one batch per `step`, RequestDeltas out.

    Each step schedules (the scheduler decides who runs), executes (one forward pass), samples, and
    appends each sampled token to its request, which says whether it ended (`Request.append`)."""

    def __init__(
        self, parts: EngineParts, clock: Callable[[], float] = time.perf_counter, probe_now: bool = True
    ) -> None:
        """An engine on `parts` (engine/factory.py), built by `from_config` or, in a test, another way.
        `clock` times the steps (and the startup probe) whose costs the drafter weighs. Without
        `probe_now`, the probe waits for `probe_step` calls (a server runs them once it listens), and the
        first `step` finishes what is left of it."""
        self.config = parts.config
        self.model = parts.model
        self.tokenizer = parts.model.tokenizer
        self.runner = parts.runner
        self.kv = parts.kv
        self.scheduler = parts.scheduler
        self.limits = parts.limits
        self.grammars = parts.grammars
        self.masks = MaskWorker()
        self.max_model_len = parts.max_model_len
        self.bytes_per_block = parts.bytes_per_block
        self._threads = torch.get_num_threads()
        self.replies = ReplyMemory()
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        # Seeds for requests that bring none: a run of the same requests samples the same text.
        self._seeds = random.Random(self.config.seed)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.clock = clock
        # Speculation's cost model: a probe now, then every step (none where speculation is off: its
        # warm-up step alone).
        self.step_costs = LoadCostEstimator(ROW_COST) if self.scheduler.drafter is not None else None
        self._probe: Iterator[ProbeStep | None] | None = (
            probe_steps(self.runner, self.kv, self.max_model_len, self.clock)
            if self.step_costs is not None
            else warm_up_steps(self.runner, self.kv, self.max_model_len, self.clock)
        )
        if probe_now:
            self.finish_probe()

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        model: LoadedModel | None = None,
        clock: Callable[[], float] = time.perf_counter,
        probe_now: bool = True,
    ) -> "Engine":
        """An engine on the parts `config` builds (`build_parts`), on `model` when given, else on the
        model the config names; raises ConfigError for settings this model cannot run with."""
        return cls(build_parts(config, model), clock, probe_now)

    @property
    def probing(self) -> bool:
        """Whether the startup probe has steps left."""
        return self._probe is not None

    def probe_step(self) -> None:
        """Run the startup probe's next step: a few timed steps of the model with and without draft rows
        (engine/cost_probe.py), or without speculation its warm-up step alone; after the last, the
        estimate is anchored to what they gave. The cache is left as it was after each."""
        if self._probe is None:
            return
        try:
            step = next(self._probe)
        except StopIteration:
            self._probe = None
            if self.step_costs is not None:
                if self.step_costs.steps:
                    self.step_costs.anchor(self.step_costs.costs.overall)
                self._use_costs(self.step_costs.costs)
            return
        if step is not None and self.step_costs is not None:
            self.step_costs.observe(step.decodes, step.drafts, 0, step.seconds)

    def finish_probe(self) -> None:
        while self._probe is not None:
            self.probe_step()

    def _use_costs(self, costs: RowShares) -> None:
        drafter = self.scheduler.drafter
        if isinstance(drafter, Drafter):
            drafter.costs = costs

    @property
    def num_blocks(self) -> int:
        return self.kv.pool.num_blocks

    @property
    def request_pool_tokens(self) -> int:
        """The KV tokens one request may use: the pool less what pins may hold."""
        return (self.num_blocks - self.kv.max_pinned_blocks) * self.config.block_size

    def validate_request(
        self, prompts: Sequence[Sequence[int] | CheckedPrompt], params: SamplingParams, namespace: str = ""
    ) -> list[CheckedPrompt]:
        """Check a request (its prompts, each run params.n times) against what this engine holds: see
        engine/validation.py. Reads only fixed settings and the thread-safe grammar cache, so any thread
        may call it; it compiles the request's constraint (cached in `namespace`), so callers off the
        engine thread should."""
        return validate_request(self.limits, prompts, params, self.grammars, namespace)

    def checked_prompt(
        self, prompt: Sequence[int] | CheckedPrompt, params: SamplingParams, namespace: str = ""
    ) -> CheckedPrompt:
        """The rule of every door that queues a sample: a CheckedPrompt checked with `params`, or with the
        request they are a sample of (`CheckedPrompt.checked_for`), is its own proof; any other prompt is
        checked now. Any thread may call it (see validate_request)."""
        if isinstance(prompt, CheckedPrompt) and prompt.checked_for(params):
            return prompt
        (checked,) = self.validate_request([prompt], params, namespace)
        return checked

    def add_request(
        self,
        request_id: str,
        prompt: Sequence[int] | CheckedPrompt,
        params: SamplingParams,
        namespace: str = "",
        tenant: str = DEFAULT_TENANT,
        checkpoints: Sequence[int] = (),
    ) -> Request:
        """Queue a request; raises InvalidRequestError when it can never be served as asked.
        `checkpoints`: prompt positions (breakpoints) where a hybrid model keeps its state, besides the
        message ends it finds itself (`turn_ends`).

        One request is one sample: callers run `n > 1` as n requests with `params.for_sample(i)`, which
        share the prompt's KV through the prefix cache. A prompt that `validate_request` checked with
        these params (or the request's, of which these are a sample) is not checked again; any other
        prompt is. `tenant` is whose share of the queue and the running slots the request counts in (see
        the scheduler); `namespace` is the cache namespace its KV lives in."""
        if not isinstance(params, SamplingParams) or params.n != 1:
            raise InvalidRequestError("an engine request is one sample: submit params.for_sample(i)", "n")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        checked = self.checked_prompt(prompt, params, namespace)
        request = self._new_request(request_id, checked, params, namespace, tenant, checkpoints)
        self.requests[request_id] = request
        self.scheduler.add(request)
        self.prompt_tokens += request.num_prompt_tokens
        return request

    def _new_request(
        self,
        request_id: str,
        checked: CheckedPrompt,
        params: SamplingParams,
        namespace: str,
        tenant: str,
        checkpoints: Sequence[int] = (),
    ) -> Request:
        stream = TextStream(
            self.tokenizer.decode_stream(params.skip_special_tokens),
            params.stop,
            params.include_stop_str_in_output,
        )
        return Request(
            request_id,
            checked.token_ids,
            params,
            checked.max_tokens,
            stream,
            namespace,
            arrival=next(self._arrivals),
            seed=self._seeds.randrange(2**63),
            tenant=tenant,
            grammar=None if checked.grammar is None else checked.grammar.start(),
            eos_token_ids=self.tokenizer.eos_token_ids,
            max_model_len=self.max_model_len,
            checkpoints=[*checkpoints, *self.turn_ends(checked.token_ids)],
        )

    def turn_ends(self, token_ids: Sequence[int]) -> list[int]:
        """A hybrid model's message boundaries in a prompt: the positions just after each end-of-turn
        token (the tokenizer's end-of-sequence ids, which chat templates close every message with), so
        that another request sharing the messages before one resumes there. Empty for other models."""
        if not self.kv.states.enabled or not self.tokenizer.eos_token_ids:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        return (np.flatnonzero(np.isin(ids, self.tokenizer.eos_token_ids)) + 1).tolist()  # type: ignore[no-any-return]

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks (they stay cached); False if it is unknown or done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request)
        request.finish_reason = "abort"
        if self.scheduler.drafter is not None:
            self.scheduler.drafter.finished(request_id, request.namespace, [], request.tenant)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestDelta]:
        """One engine step: schedule, execute the batch, sample a token for each request that samples,
        append it. Returns a delta for each request that sampled."""
        # The drafter weighs rows by the probe's costs: a step never runs before them.
        self.finish_probe()
        began = self.clock()
        self.kv.expire_pins()
        self.kv.expire_retentions()
        scheduled = self._schedule()
        if scheduled is None:
            return []
        # The constrained rows' masks need only their tokens so far: computed while the forward pass runs.
        masks = self.masks.start(scheduled.sampled)
        logits = self._execute(scheduled)
        taken = self._take(scheduled, logits.sampled, masks)
        self.scheduler.after_step(scheduled, {r.request_id: len(t.appended) for r, t in taken})
        deltas = [self._deliver(request, t) for request, t in taken]
        if self.step_costs is not None:
            self._measured(self.step_costs, scheduled, self.clock() - began)
        return deltas

    def _measured(self, estimator: LoadCostEstimator, scheduled: ScheduledStep, seconds: float) -> None:
        """The step took `seconds`: refine what its rows cost (any value is safe, see step_cost.py)."""
        drafts = sum(len(d) for d in scheduled.drafts.values())
        prefill = sum(len(c.token_ids) for _, c in scheduled.prefills)
        estimator.observe(len(scheduled.decodes), drafts, prefill, seconds)
        self._use_costs(estimator.costs)

    def _schedule(self) -> ScheduledStep | None:
        """The scheduler's batch for this step; None when it has nothing to run."""
        scheduled = self.scheduler.schedule()
        if not scheduled.empty:
            return scheduled
        if self.kv.loads_pending:
            # Nothing to run until a load is admitted: wait for one to be ready, briefly, so that
            # commands (a new request, an abort, a health check) are still answered between steps.
            self.kv.wait_for_loads(LOAD_WAIT_S)
            return None
        if self.scheduler.has_work() and not scheduled.preempted:
            # Every request that passed validation fits the pool, so this is a scheduler bug: fail
            # loudly rather than spin with requests that can never run.
            raise RuntimeError(
                f"the scheduler made no progress with {len(self.scheduler.waiting)} waiting and "
                f"{len(self.scheduler.running)} running requests"
            )
        return None

    def _execute(self, scheduled: ScheduledStep) -> StepLogits:
        """One forward pass over the batch; scores the prompt positions of chunks that asked for them."""
        if self.config.single_token_threads is not None:
            threads = self.config.single_token_threads if scheduled.num_tokens == 1 else self._threads
            # Only on a change: a stream decoding alone keeps one count step after step.
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        logits = self.runner.execute(scheduled.batch)
        scoring = [(r, c) for r, c in scheduled.prefills if c.all_logits]
        for (request, chunk), chunk_logits in zip(scoring, logits.chunks, strict=True):
            self._score_prompt(request, chunk.start, chunk_logits)
        return logits

    def _take(
        self, scheduled: ScheduledStep, logits: torch.Tensor, masks: StepMasks | None
    ) -> list[tuple[Request, Taken]]:
        """Sample each request's rows in order and append what they give (`Request.append`): the first
        row's token always; a draft's next row only while each token sampled equals the draft's token
        at that row, and the request goes on (see `verify` in engine/speculation.py)."""
        requests = scheduled.sampled
        taken = verify(
            logits,
            requests,
            [scheduled.draft(r) for r in requests],
            lambda rows, chosen, first: self._sample(rows, chosen, masks if first else None),
        )
        drafter = self.scheduler.drafter
        if drafter is not None:
            for request, t in zip(requests, taken, strict=True):
                if draft := scheduled.draft(request):
                    drafter.verified(request.request_id, len(draft), len(t.appended) - 1)
        return list(zip(requests, taken, strict=True))

    def _sample(
        self, logits: torch.Tensor, requests: list[Request], masks: StepMasks | None
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """A token for each row, and its logprob for the rows whose request asked."""
        tokens = sampler.sample(logits, requests, self.tokenizer.eos_token_ids, masks)
        return tokens, self._token_logprobs(logits, requests, tokens)

    def _score_prompt(self, request: Request, start: int, logits: torch.Tensor) -> None:
        """Logits at prompt positions start, start+1, ... score the prompt tokens after them; positions
        scored before (a chunk recomputed after preemption) are skipped."""
        scored = request.prompt_logprobs
        assert scored is not None and request.params.prompt_logprobs is not None
        first = len(scored) - 1 - start
        # Admission never uses a cached prefix beyond the positions already scored.
        assert first >= 0, "a prompt-logprobs chunk skipped positions that were never scored"
        last = min(logits.shape[0], request.num_prompt_tokens - 1 - start)
        if first >= last:
            return
        targets = request.token_ids[start + first + 1 : start + last + 1]
        scored += token_logprobs(logits[first:last], targets, request.params.prompt_logprobs)

    @staticmethod
    def _token_logprobs(
        logits: torch.Tensor, sampled: Sequence[Request], tokens: Sequence[int]
    ) -> list[TokenLogprob | None]:
        """Logprobs of the sampled tokens, for the rows that asked (none computed when none did)."""
        rows = [i for i, r in enumerate(sampled) if r.params.logprobs is not None]
        out: list[TokenLogprob | None] = [None] * len(sampled)
        if not rows:
            return out
        # One top-k for all rows: the widest asked for, each row then keeps its own k.
        widest = max(sampled[i].params.logprobs or 0 for i in rows)
        for i, logprob in zip(
            rows, token_logprobs(logits[rows], [tokens[i] for i in rows], widest), strict=True
        ):
            k = sampled[i].params.logprobs or 0
            out[i] = TokenLogprob(logprob.token_id, logprob.logprob, logprob.rank, logprob.top[:k])
        return out

    def _deliver(self, request: Request, taken: Taken) -> RequestDelta:
        """The request's delta for this step's tokens; ends it if they did."""
        token_ids = [t for a in taken.appended for t in a.token_ids]
        self.generation_tokens += len(token_ids)
        reason = taken.appended[-1].finish_reason
        if reason is not None:
            self._finish(request, reason)
        return RequestDelta(
            request_id=request.request_id,
            token_ids=token_ids,
            text="".join(a.text for a in taken.appended),
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            num_recomputed_tokens=request.num_recomputed_tokens or 0,
            num_output_tokens=request.num_output_tokens,
            logprobs=[
                lp
                for a, lp in zip(taken.appended, taken.logprobs, strict=True)
                if lp is not None and a.token_ids
            ],
            prompt_logprobs=taken.prompt_logprobs,
            cache_miss=request.cache_miss,
        )

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        self.scheduler.finish(request)
        self.requests.pop(request.request_id, None)
        # Unless a stop string cut it, the reply's text is its tokens (minus a stop token): remember them,
        # so that the next turn of the chat finds this reply in the cache token for token.
        reply = request.reply_token_ids
        if self.scheduler.drafter is not None:
            self.scheduler.drafter.finished(request.request_id, request.namespace, reply, request.tenant)
        if (
            reply
            and not request.text_stream.stopped
            and self.tokenizer.decode(reply, request.params.skip_special_tokens) == request.text_stream.text
        ):
            self.replies.remember(request.namespace, request.text_stream.text, reply, request.tenant)

    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()

    def pin(self, namespace: str, tokens: Sequence[int], ttl_s: float) -> Pin | None:
        """Pin the full blocks of `tokens` in memory for `ttl_s` seconds; None if they are not all cached
        (run the prompt first). Raises PinRefused (a ValueError) when the cache cannot take the pin, and
        InvalidRequestError (also a ValueError), before touching the cache, for token ids that no prompt
        could hold."""
        ids = validate_token_ids(self.limits, tokens)
        self.kv.expire_pins()
        return self.kv.pin(namespace, ids, ttl_s)

    def unpin(self, namespace: str, pin_id: str) -> bool:
        return self.kv.unpin(namespace, pin_id)

    def retain(
        self, namespace: str, tokens: Sequence[int], breakpoints: Sequence[tuple[int, float]]
    ) -> list[int]:
        """Hold the cached prefix of `tokens` up to each breakpoint (length, ttl_s) against eviction
        (KVCacheManager.retain); returns the tokens held for each. Never raises for input: token ids
        that no prompt could hold retain nothing, and so do breakpoints that are not a length within
        them with a positive TTL, or that hold less than a block."""
        try:
            ids = validate_token_ids(self.limits, tokens)
        except InvalidRequestError:
            return [0] * len(breakpoints)
        self.kv.expire_retentions()
        return self.kv.retain(namespace, ids, breakpoints)

    def pins(self, namespace: str) -> list[Pin]:
        self.kv.expire_pins()
        return self.kv.pins(namespace)

    def close(self) -> None:
        """Write what the lower cache tiers have queued and stop their threads (and the masks' thread)."""
        self.kv.close()
        self.masks.close()

    def stats(self) -> EngineStats:
        c = self.scheduler.counters
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            cache_queries=c.cache_queries,
            cache_hits=c.cache_hits,
            hits_by_tier=dict(c.hits_by_tier),
            prefill_tokens_computed=c.prefill_tokens_computed,
            preemptions=c.preemptions,
            recomputed_tokens=c.recomputed_tokens,
            cache=self.kv.usage(),
            spec_drafts=c.drafts,
            spec_draft_tokens=c.draft_tokens,
            spec_accepted_tokens=c.accepted_tokens,
            step_costs=None if self.step_costs is None else self.step_costs.costs.overall,
            misses_by_reason=dict(c.misses),
        )
