"""Request: one generation's tokens, KV blocks and progress, as the scheduler and engine see it."""

import enum
import time

import torch

from kvserve.cache.manager import SequenceBlocks
from kvserve.engine.grammar import GrammarState
from kvserve.engine.logprobs import TokenLogprob
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.text_stream import TextStream

# The fairness key of requests that name no tenant (one tenant: first come, first served).
DEFAULT_TENANT = "default"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """`token_ids` is the prompt followed by the generated tokens. While running, the KV of
    token_ids[:num_computed] is in `kv.blocks`; the last sampled token's KV is computed in the next step.
    `seed` drives sampling when the params give none. `tenant` is the fairness key: the scheduler shares
    admission between tenants (see scheduler.py).

    With `params.prompt_logprobs`, `prompt_logprobs` grows as chunks compute logits at prompt positions:
    entry p scores prompt token p (entry 0 is None: nothing precedes the first token)."""

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
    ) -> None:
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
        self.num_computed = 0
        self.num_cached_tokens: int | None = None
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
