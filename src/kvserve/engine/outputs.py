"""What the engine reports: per-step deltas while streaming, whole RequestOutputs offline."""

from dataclasses import dataclass, field

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
