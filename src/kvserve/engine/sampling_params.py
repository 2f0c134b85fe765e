"""SamplingParams: how one request picks its tokens and when it stops (shaped like vLLM's)."""

from dataclasses import dataclass, field

from kvserve.errors import InvalidRequestError


@dataclass
class SamplingParams:
    """`max_tokens=None` means up to the model's context length. `temperature=0` is greedy.

    `top_k <= 0`, `top_p = 1` and `min_p = 0` disable those filters. A `seed` makes sampling reproducible
    for this request whatever else runs in the same batch.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks: list[tuple[bool, str, str]] = [
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "max_tokens must be at least 1"),
            (0.0 <= self.temperature <= 100.0, "temperature", "temperature must be between 0 and 100"),
            (0.0 < self.top_p <= 1.0, "top_p", "top_p must be in (0, 1]"),
            (self.top_k >= -1, "top_k", "top_k must be -1 or 0 (disabled) or a positive integer"),
            (0.0 <= self.min_p <= 1.0, "min_p", "min_p must be in [0, 1]"),
            (self.n == 1, "n", "only n=1 is supported"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty"),
            (len(self.stop) <= 16, "stop", "at most 16 stop strings are supported"),
            (
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids",
                "stop_token_ids must be non-negative integers",
            ),
            (
                self.seed is None or 0 <= self.seed < 2**63,
                "seed",
                "seed must be a non-negative 64-bit integer",
            ),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequestError(message, param)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
