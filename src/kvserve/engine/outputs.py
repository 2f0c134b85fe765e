"""What the engine reports: per-step deltas while streaming, and what folds them into whole outputs.

`PromptOutputs` is the one accumulator: the server's choices and usage and `LLM`'s RequestOutputs are
both read from it, so the n samples of a prompt add up (text, ids, logprobs, finish reason, the cached
count of the prompt) in one place.
"""

from dataclasses import dataclass, field

from kvserve.cache.cache_miss import CacheMiss
from kvserve.engine.logprobs import TokenLogprob


@dataclass
class RequestDelta:
    """What one step added to one request: new tokens and the text they completed, the new tokens'
    logprobs when asked for, and in the request's first delta its prompt logprobs when asked for."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # A hybrid model's prompt tokens the cache held but recomputed for want of a state checkpoint.
    num_recomputed_tokens: int = 0
    # Why its admission computed text its namespace had seen (None: it did not, or not yet admitted).
    cache_miss: CacheMiss | None = None


@dataclass
class SampleOutput:
    """One sample of a prompt as its deltas arrive."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0
    # What the prefix cache held of the prompt when the sample was admitted; None before its first delta.
    num_cached_tokens: int | None = None
    # What it held past that but was recomputed (a hybrid model's missing checkpoint).
    num_recomputed_tokens: int = 0
    cache_miss: CacheMiss | None = None


@dataclass
class PromptOutputs:
    """The samples of one prompt, folded from their deltas by `add`."""

    num_prompt_tokens: int
    samples: list[SampleOutput]
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @classmethod
    def start(cls, num_prompt_tokens: int, n: int) -> "PromptOutputs":
        return cls(num_prompt_tokens, [SampleOutput() for _ in range(n)])

    def add(self, sample: int, delta: RequestDelta) -> SampleOutput:
        """Fold one delta of sample `sample` in; returns that sample."""
        out = self.samples[sample]
        out.text += delta.text
        out.token_ids += delta.token_ids
        out.logprobs += delta.logprobs
        out.finish_reason = delta.finish_reason
        out.num_output_tokens = delta.num_output_tokens
        out.num_cached_tokens = delta.num_cached_tokens
        out.num_recomputed_tokens = delta.num_recomputed_tokens
        out.cache_miss = delta.cache_miss
        self.num_prompt_tokens = delta.num_prompt_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        return out

    @property
    def num_cached_tokens(self) -> int:
        """What was cached of the prompt before the request: the fewest any sample found (the samples
        after the first find what the first computed)."""
        return min((s.num_cached_tokens for s in self.samples if s.num_cached_tokens is not None), default=0)

    @property
    def num_recomputed_tokens(self) -> int:
        """Prompt tokens the cache held but recomputed for want of a state checkpoint (hybrid models),
        in the sample that found the fewest cached."""
        started = [s for s in self.samples if s.num_cached_tokens is not None]
        return min(started, key=lambda s: s.num_cached_tokens or 0).num_recomputed_tokens if started else 0

    @property
    def cache_miss(self) -> CacheMiss | None:
        """The prompt's miss, as the sample that computed it found it (the others read what it did)."""
        return next((s.cache_miss for s in self.samples if s.cache_miss is not None), None)

    @property
    def num_output_tokens(self) -> int:
        return sum(s.num_output_tokens for s in self.samples)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


@dataclass(frozen=True)
class Logprob:
    """vLLM's shape: a token's log probability, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: the token there and the top-k alternatives, by token id (vLLM's shape).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[PositionLogprobs] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
