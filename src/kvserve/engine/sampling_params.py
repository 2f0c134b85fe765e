"""SamplingParams: how a request picks its tokens, what it reports and when it stops (shaped like vLLM's).

A SamplingParams checks its own fields when it is made (types, ranges, finiteness: whatever needs no
engine), and is frozen, so that what was checked stays true. What depends on the engine (the vocabulary,
the context, the caps of one request) is checked by `validate_request` (engine/validation.py), the one
door every request goes through.
"""

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch

from kvserve.engine.grammar import StructuredOutputs
from kvserve.errors import InvalidRequestError

# As in vLLM: top-k lists of sampled and prompt tokens go up to 20 entries.
MAX_LOGPROBS = 20
# Seeds are unsigned 64-bit integers; the seeds of the samples of one request (n > 1) wrap around.
SEED_SPACE = 2**64
MAX_STOP_STRINGS = 16
# stop_token_ids are held back from sampling until min_tokens: a bounded set, kept far from the vocabulary.
MAX_STOP_TOKEN_IDS = 1024
# OpenAI's range for one logit bias.
MAX_LOGIT_BIAS = 100.0
MAX_TEMPERATURE = 100.0
# Below this a temperature is sampled greedily: dividing logits by it would overflow float32 (as vLLM).
MIN_SAMPLED_TEMPERATURE = 1e-5
# Bounds that keep penalized logits finite in float32 (logits divided or multiplied by at most 100).
MAX_PENALTY = 2.0
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    """A finite number (a bool is not one; a huge int is finite and compares exactly)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def _optional_int(value: object) -> bool:
    return value is None or _is_int(value)


@dataclass(frozen=True)
class SamplingParams:
    """`max_tokens=None` means up to the model's context length; 0 computes only the prompt (for
    `prompt_logprobs`). `temperature=0` is greedy, and so is any temperature below 1e-5.

    `top_k <= 0`, `top_p = 1` and `min_p = 0` disable those filters. A `seed` (0 .. 2**64 - 1) makes
    sampling reproducible for this request whatever else runs in the same batch; with `n > 1`, sample i
    uses `seed + i` (modulo 2**64).

    `logprobs=k` reports each sampled token's log probability and the k most likely tokens at its step;
    `prompt_logprobs=k` the same for every prompt token (the first has none). Both are of the model's
    distribution before temperature, penalties, biases and filters.

    Penalties follow OpenAI (`presence_penalty`, `frequency_penalty`: subtracted from the logits of tokens
    already generated) and vLLM (`repetition_penalty`: divides positive and multiplies negative logits of
    tokens in the prompt or the output). `logit_bias` adds to the logits of the given token ids.
    `min_tokens` forbids the end-of-sequence and stop tokens, and ignores stop strings, until that many
    tokens are generated.

    `structured_outputs` constrains the output to a JSON schema, a regex, a choice or a grammar (see
    engine/grammar.py): a token mask applied after penalties and biases, before temperature and filters.
    The end of sequence is allowed only where the grammar accepts; logprobs stay those of the model.
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
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        # Frozen: the normalizing assignments below are the only ones a SamplingParams ever sees.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        elif isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", list(self.stop))
        if isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids))
        if self.logit_bias is not None and not self.logit_bias:
            object.__setattr__(self, "logit_bias", None)
        # In order, stopping at the first failure: a later check relies on the types earlier ones proved.
        for name, ok, message in self._checks():
            if not ok():
                raise InvalidRequestError(message, name)

    def _checks(self) -> list[tuple[str, Callable[[], bool], str]]:
        top_n = (None, *range(MAX_LOGPROBS + 1))
        return [
            (
                "max_tokens",
                lambda: self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 0),
                "max_tokens must be a non-negative integer",
            ),
            (
                "temperature",
                lambda: _is_real(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE,
                f"temperature must be between 0 and {MAX_TEMPERATURE:g}",
            ),
            ("top_p", lambda: _is_real(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (
                "top_k",
                lambda: _is_int(self.top_k) and self.top_k >= -1,
                "top_k must be -1 or 0 (disabled) or a positive integer",
            ),
            ("min_p", lambda: _is_real(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            ("n", lambda: _is_int(self.n) and self.n >= 1, "n must be a positive integer"),
            (
                "stop",
                lambda: (
                    isinstance(self.stop, list)
                    and len(self.stop) <= MAX_STOP_STRINGS
                    and all(isinstance(s, str) and s for s in self.stop)
                ),
                f"stop must be at most {MAX_STOP_STRINGS} non-empty strings",
            ),
            (
                "stop_token_ids",
                lambda: (
                    isinstance(self.stop_token_ids, list)
                    and len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS
                    and all(_is_int(t) and t >= 0 for t in self.stop_token_ids)
                ),
                f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} non-negative integers",
            ),
            (
                "seed",
                lambda: self.seed is None or (_is_int(self.seed) and 0 <= self.seed < SEED_SPACE),
                "seed must be an unsigned 64-bit integer (0 to 2**64 - 1)",
            ),
            (
                "include_stop_str_in_output",
                lambda: isinstance(self.include_stop_str_in_output, bool),
                "include_stop_str_in_output must be a boolean",
            ),
            ("ignore_eos", lambda: isinstance(self.ignore_eos, bool), "ignore_eos must be a boolean"),
            (
                "min_tokens",
                lambda: _is_int(self.min_tokens) and self.min_tokens >= 0,
                "min_tokens must be a non-negative integer",
            ),
            (
                "min_tokens",
                lambda: self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens must not exceed max_tokens",
            ),
            (
                "skip_special_tokens",
                lambda: isinstance(self.skip_special_tokens, bool),
                "skip_special_tokens must be a boolean",
            ),
            (
                "logprobs",
                lambda: _optional_int(self.logprobs) and self.logprobs in top_n,
                f"logprobs must be between 0 and {MAX_LOGPROBS}",
            ),
            (
                "prompt_logprobs",
                lambda: _optional_int(self.prompt_logprobs) and self.prompt_logprobs in top_n,
                f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}",
            ),
            (
                "presence_penalty",
                lambda: (
                    _is_real(self.presence_penalty) and -MAX_PENALTY <= self.presence_penalty <= MAX_PENALTY
                ),
                f"presence_penalty must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
            ),
            (
                "frequency_penalty",
                lambda: (
                    _is_real(self.frequency_penalty) and -MAX_PENALTY <= self.frequency_penalty <= MAX_PENALTY
                ),
                f"frequency_penalty must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]",
            ),
            (
                "repetition_penalty",
                lambda: (
                    _is_real(self.repetition_penalty)
                    and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY
                ),
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]",
            ),
            (
                "logit_bias",
                lambda: (
                    self.logit_bias is None
                    or (
                        isinstance(self.logit_bias, dict)
                        and all(
                            _is_int(t) and t >= 0 and _is_real(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
                            for t, b in self.logit_bias.items()
                        )
                    )
                ),
                "logit_bias maps token ids (non-negative integers) to finite biases in [-100, 100]",
            ),
            (
                "structured_outputs",
                lambda: isinstance(self.structured_outputs, StructuredOutputs | None),
                "structured_outputs must be a StructuredOutputs",
            ),
        ]

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLED_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @cached_property
    def max_token_id(self) -> int:
        """The largest token id the params name (logit_bias keys, stop_token_ids); -1 if none. Cached, so
        that checking against a vocabulary costs nothing per sample."""
        return max((*(self.logit_bias or ()), *self.stop_token_ids), default=-1)

    @cached_property
    def logit_bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token ids, biases) of `logit_bias`, built once and shared by every sample and step."""
        if not self.logit_bias:
            return None
        ids = torch.tensor(list(self.logit_bias.keys()), dtype=torch.long)
        values = torch.tensor(list(self.logit_bias.values()), dtype=torch.float32)
        return ids, values

    def for_sample(self, index: int) -> "SamplingParams":
        """The params of sample `index` of n: one sample, its own seed (so n seeded samples differ).

        A shallow copy, not a new construction: the fields were checked once, and the copy shares the
        big ones (logit_bias) and what was derived from them (its tensors) with every other sample."""
        sample = copy.copy(self)
        object.__setattr__(sample, "n", 1)
        object.__setattr__(sample, "seed", None if self.seed is None else (self.seed + index) % SEED_SPACE)
        return sample
