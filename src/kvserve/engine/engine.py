"""Engine: the synchronous step loop. add_request -> step() -> RequestDeltas, until every request ends."""

import itertools
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.cache.disk_tier import DiskTier
from kvserve.cache.lower_tiers import LowerTiers
from kvserve.cache.manager import CacheUsage, KVCacheManager, Pin
from kvserve.cache.redis_tier import RedisTier
from kvserve.cache.tiers import LowerTier
from kvserve.config import EngineConfig
from kvserve.engine import sampler
from kvserve.engine.grammar import GrammarCompiler
from kvserve.engine.logprobs import TokenLogprob, token_logprobs
from kvserve.engine.outputs import RequestDelta
from kvserve.engine.reply_memory import ReplyMemory
from kvserve.engine.request import DEFAULT_TENANT, Request
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.text_stream import TextStream
from kvserve.engine.validation import CheckedPrompt, RequestLimits, validate_request, validate_token_ids
from kvserve.errors import InvalidRequestError
from kvserve.model.fingerprint import model_fingerprint
from kvserve.model.loader import LoadedModel, load_model
from kvserve.model.runner import DTYPES, ModelRunner
from kvserve.secret import DISK_TIER_PURPOSE, derive_key, load_or_create_secret

log = logging.getLogger("kvserve.engine")


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

    @property
    def hit_rate(self) -> float:
        return self.cache_hits / self.cache_queries if self.cache_queries else 0.0


class Engine:
    def __init__(self, config: EngineConfig, model: LoadedModel | None = None) -> None:
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        self._threads = torch.get_num_threads()
        started = time.monotonic()
        self.model = model or load_model(config.model, config.cache_dir)
        self.tokenizer = self.model.tokenizer
        mc = self.model.config
        self.max_model_len = self._max_model_len()
        self.bytes_per_block = (
            mc.kv_bytes_per_token(DTYPES[config.kv_cache_dtype].itemsize) * config.block_size
        )
        num_blocks = config.kv_cache_memory // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory={config.kv_cache_memory} bytes is below one KV block "
                f"({self.bytes_per_block})"
            )
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            config.block_size,
            self.max_model_len,
            config.device,
            config.dtype,
            config.weight_dtype,
            config.attention,
            config.cache_dir,
            config.kv_cache_dtype,
        )
        max_pinned_blocks = config.max_pinned_tokens // config.block_size
        if max_pinned_blocks >= num_blocks:
            raise ValueError(
                f"max_pinned_tokens={config.max_pinned_tokens} leaves no room in a pool of "
                f"{num_blocks * config.block_size} tokens; lower it or raise kv_cache_memory"
            )
        self.kv = KVCacheManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            self._lower_tiers(),
            max_pinned_blocks,
            max_pinned_blocks_per_namespace=(
                None
                if config.max_pinned_tokens_per_tenant is None
                else config.max_pinned_tokens_per_tenant // config.block_size
            ),
        )
        self.scheduler = Scheduler(config, self.kv)
        self.limits = RequestLimits(
            vocab_size=mc.vocab_size,
            max_model_len=self.max_model_len,
            max_request_tokens=self.request_pool_tokens,
            max_sequences_per_request=config.max_sequences_per_request,
        )
        # Structured outputs: compiled where requests are validated, never on the engine thread's step.
        self.grammars = GrammarCompiler(
            self.tokenizer.hf_tokenizer, self.tokenizer.vocab_size, self.tokenizer.eos_token_ids
        )
        self.replies = ReplyMemory()
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        # Seeds for requests that bring none: a run of the same requests samples the same text.
        self._seeds = random.Random(config.seed)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        log.info(
            "engine ready in %.1fs: %s, %d KV blocks of %d tokens (%d tokens), max_model_len %d, "
            "prefix cache %s, disk tier %s, redis tier %s",
            time.monotonic() - started,
            self.model.name,
            num_blocks,
            config.block_size,
            num_blocks * config.block_size,
            self.max_model_len,
            "on" if config.enable_prefix_caching else "off",
            config.kv_disk or "off",
            "on" if config.kv_remote else "off",
        )

    def _lower_tiers(self) -> LowerTiers | None:
        c = self.config
        if c.kv_disk is None and c.kv_remote is None:
            return None
        fingerprint = model_fingerprint(self.model, c.weight_dtype, c.block_size, c.kv_cache_dtype)
        secret = c.secret if c.secret is not None else load_or_create_secret(c.cache_dir)
        tiers: list[LowerTier] = []
        if c.kv_disk is not None:
            tiers.append(
                DiskTier(c.kv_disk, c.kv_disk_size, fingerprint, derive_key(secret, DISK_TIER_PURPOSE))
            )
        if c.kv_remote is not None:
            tiers.append(RedisTier(c.kv_remote, secret))
        return LowerTiers(tiers, self.runner.kv_cache, fingerprint, c.block_size)

    def _max_model_len(self) -> int:
        mc = self.model.config
        limit = mc.max_position_embeddings
        if mc.sliding_window is not None:
            # Our attention has no sliding window: staying inside it keeps the output exact.
            limit = min(limit, mc.sliding_window)
        asked = self.config.max_model_len
        if asked is not None and asked > limit:
            raise ValueError(f"max_model_len {asked} exceeds what the model supports ({limit})")
        return asked or limit

    @property
    def num_blocks(self) -> int:
        return self.kv.pool.num_blocks

    @property
    def request_pool_tokens(self) -> int:
        """The KV tokens one request may use: the pool less what pins may hold."""
        return (self.num_blocks - self.kv.max_pinned_blocks) * self.config.block_size

    def validate_request(
        self, prompts: Sequence[Sequence[int] | CheckedPrompt], params: SamplingParams
    ) -> list[CheckedPrompt]:
        """Check a request (its prompts, each run params.n times) against what this engine holds: see
        engine/validation.py. Reads only fixed settings and the thread-safe grammar cache, so any thread
        may call it; it compiles the request's constraint, so callers off the engine thread should."""
        return validate_request(self.limits, prompts, params, self.grammars)

    def add_request(
        self,
        request_id: str,
        prompt: Sequence[int] | CheckedPrompt,
        params: SamplingParams,
        namespace: str = "",
        tenant: str = DEFAULT_TENANT,
    ) -> Request:
        """Queue a request; raises InvalidRequestError when it can never be served as asked.

        One request is one sample: callers run `n > 1` as n requests with `params.for_sample(i)`, which
        share the prompt's KV through the prefix cache. A prompt that `validate_request` checked with
        these params (or the request's, of which these are a sample) is not checked again; any other
        prompt is. `tenant` is whose share of the queue and the running slots the request counts in (see
        the scheduler); `namespace` is the cache namespace its KV lives in."""
        if not isinstance(params, SamplingParams) or params.n != 1:
            raise InvalidRequestError("an engine request is one sample: submit params.for_sample(i)", "n")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        if isinstance(prompt, CheckedPrompt) and prompt.checked_for(params):
            checked = prompt
        else:
            (checked,) = self.validate_request([prompt], params)
        n = len(checked.token_ids)
        max_tokens = checked.max_tokens
        stream = TextStream(
            self.tokenizer.decode_stream(params.skip_special_tokens),
            params.stop,
            params.include_stop_str_in_output,
        )
        request = Request(
            request_id,
            checked.token_ids,
            params,
            max_tokens,
            stream,
            namespace,
            arrival=next(self._arrivals),
            seed=self._seeds.randrange(2**63),
            tenant=tenant,
            grammar=None if checked.grammar is None else checked.grammar.start(),
        )
        self.requests[request_id] = request
        self.scheduler.add(request)
        self.prompt_tokens += n
        return request

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks (they stay cached); False if it is unknown or done."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request)
        request.finish_reason = "abort"
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestDelta]:
        self.kv.expire_pins()
        scheduled = self.scheduler.schedule()
        if scheduled.empty:
            if self.scheduler.has_work() and not scheduled.preempted:
                # Every request that passed validation fits the pool, so this is a scheduler bug: fail
                # loudly rather than spin with requests that can never run.
                raise RuntimeError(
                    f"the scheduler made no progress with {len(self.scheduler.waiting)} waiting and "
                    f"{len(self.scheduler.running)} running requests"
                )
            return []
        sampled = scheduled.sampled
        if self.config.single_token_threads is not None:
            threads = self.config.single_token_threads if scheduled.num_tokens == 1 else self._threads
            # Only on a change: a stream decoding alone keeps one count step after step.
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        logits = self.runner.execute(scheduled.batch)
        scoring = [r for r, c in scheduled.prefills if c.all_logits]
        for request, chunk, chunk_logits in zip(
            scoring, [c for _, c in scheduled.prefills if c.all_logits], logits.chunks, strict=True
        ):
            self._score_prompt(request, chunk.start, chunk_logits)
        tokens = sampler.sample(logits.sampled, sampled, self.tokenizer.eos_token_ids)
        chosen = self._token_logprobs(logits.sampled, sampled, tokens)
        self.scheduler.after_step(scheduled)
        return [
            self._append(request, token, logprob)
            for request, token, logprob in zip(sampled, tokens, chosen, strict=True)
        ]

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

    def _append(self, request: Request, token: int, logprob: TokenLogprob | None) -> RequestDelta:
        prompt_logprobs = None
        if request.prompt_logprobs is not None and request.num_output_tokens == 0:
            prompt_logprobs = list(request.prompt_logprobs)
        if request.max_tokens == 0:
            # The prompt alone was asked for (its logprobs): the sampled token is not part of the reply.
            self._finish(request, "length", False)
            return self._delta(request, [], [], request.text_stream.flush(), "length", prompt_logprobs)
        request.token_ids.append(token)
        if request.first_token_time is None:
            request.first_token_time = time.time()
        self.generation_tokens += 1
        params = request.params
        # Before min_tokens no stop applies (the sampler has kept stop tokens out already).
        check_stop = request.num_output_tokens >= params.min_tokens
        eos = not params.ignore_eos and token in self.tokenizer.eos_token_ids
        stop_token = check_stop and (token in params.stop_token_ids or eos)
        if stop_token and not params.include_stop_str_in_output:
            text = request.text_stream.flush()
        else:
            text = request.text_stream.push(token, check_stop)
            if stop_token:
                text += request.text_stream.flush()
        grammar_ended = request.grammar is not None and self._advance_grammar(request, token)
        if stop_token or request.text_stream.stopped:
            reason: str | None = "stop"
        elif grammar_ended:
            # The grammar consumed its end (an end-of-sequence token that ignore_eos or min_tokens kept
            # from stopping): nothing may follow it.
            reason = "stop"
            text += request.text_stream.flush()
        elif request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            reason = "length"
            text += request.text_stream.flush()
        else:
            reason = None
        if reason is not None:
            self._finish(request, reason, stop_token)
        logprobs = [] if logprob is None else [logprob]
        return self._delta(request, [token], logprobs, text, reason, prompt_logprobs)

    @staticmethod
    def _advance_grammar(request: Request, token: int) -> bool:
        """Move the request's grammar past `token`; True if the grammar has ended."""
        grammar = request.grammar
        assert grammar is not None
        if not grammar.accept(token):
            # The mask allows only what the grammar accepts, so this is the end-of-sequence fallback of
            # a grammar that this model's vocabulary cannot continue.
            log.warning("request %s left its grammar: %s", request.request_id, grammar.error)
        return grammar.finished

    @staticmethod
    def _delta(
        request: Request,
        token_ids: list[int],
        logprobs: list[TokenLogprob],
        text: str,
        reason: str | None,
        prompt_logprobs: list[TokenLogprob | None] | None,
    ) -> RequestDelta:
        return RequestDelta(
            request_id=request.request_id,
            token_ids=token_ids,
            text=text,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            num_output_tokens=request.num_output_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _finish(self, request: Request, reason: str, stop_token: bool) -> None:
        request.finish_reason = reason
        self.scheduler.finish(request)
        self.requests.pop(request.request_id, None)
        # Unless a stop string cut it, the reply's text is its tokens (minus a stop token): remember them,
        # so that the next turn of the chat finds this reply in the cache token for token.
        reply = request.output_token_ids[:-1] if stop_token else request.output_token_ids
        if (
            reply
            and not request.text_stream.stopped
            and self.tokenizer.decode(reply) == request.text_stream.text
        ):
            self.replies.remember(request.namespace, request.text_stream.text, reply)

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

    def pins(self, namespace: str) -> list[Pin]:
        self.kv.expire_pins()
        return self.kv.pins(namespace)

    def close(self) -> None:
        """Write what the lower cache tiers have queued and stop their threads."""
        self.kv.close()

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
            cache=self.kv.usage(),
        )
