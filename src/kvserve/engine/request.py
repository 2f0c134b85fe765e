"""Request: one generation's tokens, KV blocks and progress, as the scheduler and engine see it; and
when it ends (`Request.append`)."""

import enum
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass

import torch

from kvserve.cache.cache_miss import CacheMiss
from kvserve.cache.loader import LoadJob
from kvserve.cache.manager import SequenceBlocks
from kvserve.engine.grammar import GrammarState
from kvserve.engine.logprobs import TokenLogprob
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.text_stream import TextStream

log = logging.getLogger("kvserve.engine")

# The fairness key of requests that name no tenant (one tenant: first come, first served).
DEFAULT_TENANT = "default"
# The finish reason of a request whose grammar's matcher reached one of the server's limits.
GRAMMAR_LIMIT = "grammar_limit"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class Appended:
    """What one sampled token did to its request: the tokens and text its reply gained, and why the
    request ended there (None while it goes on)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None


class Request:
    """`token_ids` is the prompt followed by the generated tokens. While running, the KV of
    token_ids[:num_computed] is in `kv.blocks`; the last sampled token's KV is computed in the next step.
    `seed` drives sampling when the params give none. `tenant` is the fairness key: the scheduler shares
    admission between tenants (see scheduler.py).

    With `params.prompt_logprobs`, `prompt_logprobs` grows as chunks compute logits at prompt positions:
    entry p scores prompt token p (entry 0 is None: nothing precedes the first token).

    `append` takes each sampled token and decides whether the request ends there; `eos_token_ids` (the
    model's end-of-sequence tokens) and `max_model_len` (the context) are what it needs beyond `params`."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        text_stream: TextStream,
        namespace: str = "",
        arrival: int = 0,
        seed: int = 0,
        tenant: str = DEFAULT_TENANT,
        grammar: GrammarState | None = None,
        eos_token_ids: Collection[int] = (),
        max_model_len: int | None = None,
        checkpoints: Collection[int] = (),
    ) -> None:
        """`checkpoints`: positions where a hybrid model's cache should keep the recurrent state (the
        ends of the prompt's messages, as the server rendered them), besides the prompt's and reply's
        ends, which it keeps anyway."""
        self.request_id = request_id
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.namespace = namespace
        self.tenant = tenant
        self.arrival = arrival
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.kv: SequenceBlocks | None = None
        # While waiting: the blocks being read for it from the lower tiers (see the scheduler).
        self.load: LoadJob | None = None
        self.num_computed = 0
        self.num_cached_tokens: int | None = None
        # A hybrid model's tokens the KV cache held at admission but that were recomputed for want of a
        # state checkpoint (the first admission's, as num_cached_tokens).
        self.num_recomputed_tokens: int | None = None
        self.checkpoints = tuple(sorted({p for p in checkpoints if 0 < p <= len(prompt_token_ids)}))
        # Why its first admission computed text its namespace had seen (None: it did not).
        self.cache_miss: CacheMiss | None = None
        self.num_skips = 0
        # Wall-clock times for introspection (the dashboard's TTFT column).
        self.arrival_time = time.time()
        self.first_token_time: float | None = None
        self.text_stream = text_stream
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            None if params.prompt_logprobs is None else [None]
        )
        # The tokens min_tokens holds back (stop tokens, end of sequence), built by the sampler when first
        # needed and kept for the request's life.
        self.held_back_ids: torch.Tensor | None = None
        # Where the output stands in its structured-output constraint (its own, also for each of n samples).
        self.grammar = grammar
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        # Whether the last token was a stop token, which is not part of the reply's text.
        self.ended_on_stop_token = False
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator()
            self.generator.manual_seed(params.seed if params.seed is not None else seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether some prompt position still lacks the logits that score the token after it."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def max_cached_tokens(self) -> int | None:
        """How much of a cached prefix admission may use: no more than the positions already scored,
        since a cached token's KV is there but its logits are not."""
        if self.prompt_logprobs is None or not self.needs_prompt_logits:
            return None
        return len(self.prompt_logprobs) - 1

    @property
    def reply_token_ids(self) -> list[int]:
        """The output tokens that make the reply's text: all of them but an ending stop token."""
        out = self.output_token_ids
        return out[:-1] if self.ended_on_stop_token else out

    def append(self, token: int) -> Appended:
        """Take the token sampled for this request; say what it adds to the reply and whether the request
        ends here. The rules, in order:
        - max_tokens == 0 (only the prompt's logprobs were asked for): the token is not part of the reply,
          and the request ends ("length").
        - A grammar whose matcher failed computing this token's mask (it reached one of the server's
          grammar limits): the token is not part of the reply, and the request ends ("grammar_limit").
        - Before min_tokens outputs no stop applies (the sampler has kept stop tokens out already).
        - A stop token (`params.stop_token_ids`, or an end-of-sequence token unless `ignore_eos`) ends it
          ("stop"); its text is shown only with `include_stop_str_in_output`.
        - A stop string, found by the incremental detokenizer, ends it ("stop"), the text cut at it.
        - A grammar that has consumed its end ends it ("stop"): nothing may follow it. One that failed
          taking a token its mask allowed (a limit) ends it ("grammar_limit"), the token kept.
        - `max_tokens` outputs, or a full context (`max_model_len`), end it ("length").
        Text held back in case it began a stop string is flushed whenever the request ends."""
        stream = self.text_stream
        if self.max_tokens == 0:
            return Appended([], stream.flush(), "length")
        if self.grammar is not None and self.grammar.failure is not None:
            log.warning("request %s reached a grammar limit: %s", self.request_id, self.grammar.failure)
            return Appended([], stream.flush(), GRAMMAR_LIMIT)
        self.token_ids.append(token)
        if self.first_token_time is None:
            self.first_token_time = time.time()
        params = self.params
        check_stop = self.num_output_tokens >= params.min_tokens
        eos = not params.ignore_eos and token in self.eos_token_ids
        stop_token = check_stop and (token in params.stop_token_ids or eos)
        if stop_token and not params.include_stop_str_in_output:
            text = stream.flush()
        else:
            text = stream.push(token, check_stop)
            if stop_token:
                text += stream.flush()
        grammar_ended = self.grammar is not None and self._advance_grammar(token)
        if stop_token or stream.stopped:
            reason: str | None = "stop"
        elif self.grammar is not None and self.grammar.failure is not None:
            log.warning("request %s reached a grammar limit: %s", self.request_id, self.grammar.failure)
            reason = GRAMMAR_LIMIT
            text += stream.flush()
        elif grammar_ended:
            # The grammar consumed its end (an end-of-sequence token that ignore_eos or min_tokens kept
            # from stopping): nothing may follow it.
            reason = "stop"
            text += stream.flush()
        elif self.num_output_tokens >= self.max_tokens or (
            self.max_model_len is not None and self.num_tokens >= self.max_model_len
        ):
            reason = "length"
            text += stream.flush()
        else:
            reason = None
        self.ended_on_stop_token = stop_token
        return Appended([token], text, reason)

    def _advance_grammar(self, token: int) -> bool:
        """Move the grammar past `token`; True if the grammar has ended."""
        grammar = self.grammar
        assert grammar is not None
        if not grammar.accept(token) and grammar.forced_end:
            # The mask allows only what the grammar accepts, so this is the end-of-sequence fallback of
            # a grammar that this model's vocabulary cannot continue (any other refusal is a failure).
            log.warning("request %s left its grammar: %s", self.request_id, grammar.error)
        return grammar.finished
