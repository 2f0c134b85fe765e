"""SamplingParams: how a request picks its tokens, what it reports and when it stops (shaped like vLLM's)."""

from dataclasses import dataclass, field, replace

from kvserve.errors import InvalidRequestError

# As in vLLM: top-k lists of sampled and prompt tokens go up to 20 entries.
MAX_LOGPROBS = 20
# Seeds of the samples of one request (n > 1) are derived from its seed, modulo this.
_SEED_SPACE = 2**63


@dataclass
class SamplingParams:
    """`max_tokens=None` means up to the model's context length; 0 computes only the prompt (for
    `prompt_logprobs`). `temperature=0` is greedy.

    `top_k <= 0`, `top_p = 1` and `min_p = 0` disable those filters. A `seed` makes sampling reproducible
    for this request whatever else runs in the same batch; with `n > 1`, sample i uses `seed + i`.

    `logprobs=k` reports each sampled token's log probability and the k most likely tokens at its step;
    `prompt_logprobs=k` the same for every prompt token (the first has none). Both are of the model's
    distribution before temperature, penalties, biases and filters.

    Penalties follow OpenAI (`presence_penalty`, `frequency_penalty`: subtracted from the logits of tokens
    already generated) and vLLM (`repetition_penalty`: divides positive and multiplies negative logits of
    tokens in the prompt or the output). `logit_bias` adds to the logits of the given token ids.
    `min_tokens` forbids the end-of-sequence and stop tokens, and ignores stop strings, until that many
    tokens are generated.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        top_n = (None, *range(MAX_LOGPROBS + 1))
        bias = self.logit_bias or {}
        checks: list[tuple[bool, str, str]] = [
            (self.max_tokens is None or self.max_tokens >= 0, "max_tokens", "max_tokens must be at least 0"),
            (0.0 <= self.temperature <= 100.0, "temperature", "temperature must be between 0 and 100"),
            (0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "top_k must be -1 or 0 (disabled) or a positive integer"),
            (0.0 <= self.min_p <= 1.0, "min_p", "min_p must be in [0, 1]"),
            (1 <= self.n <= 128, "n", "n must be between 1 and 128"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty"),
            (len(self.stop) <= 16, "stop", "at most 16 stop strings are supported"),
            (
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids",
                "stop_token_ids must be non-negative integers",
            ),
            (
                self.seed is None or 0 <= self.seed < _SEED_SPACE,
                "seed",
                "seed must be a non-negative 64-bit integer",
            ),
            (self.min_tokens >= 0, "min_tokens", "min_tokens must be at least 0"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens",
                "min_tokens must not exceed max_tokens",
            ),
            (self.logprobs in top_n, "logprobs", f"logprobs must be between 0 and {MAX_LOGPROBS}"),
            (
                self.prompt_logprobs in top_n,
                "prompt_logprobs",
                f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}",
            ),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "presence_penalty must be in [-2, 2]"),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                "frequency_penalty",
                "frequency_penalty must be in [-2, 2]",
            ),
            (
                0.0 < self.repetition_penalty <= 100.0,
                "repetition_penalty",
                "repetition_penalty must be in (0, 100]",
            ),
            (
                all(isinstance(t, int) and t >= 0 and -100.0 <= b <= 100.0 for t, b in bias.items()),
                "logit_bias",
                "logit_bias maps token ids (non-negative integers) to biases in [-100, 100]",
            ),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def for_sample(self, index: int) -> "SamplingParams":
        """The params of sample `index` of n: one sample, its own seed (so n seeded samples differ)."""
        seed = None if self.seed is None else (self.seed + index) % _SEED_SPACE
        return replace(self, n=1, seed=seed)
