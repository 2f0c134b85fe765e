"""Offline API, shaped like vLLM's: LLM(model).generate(prompts, params) and LLM.chat(messages, params)."""

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from kvserve.config import EngineConfig
from kvserve.engine.chat import encode_chat
from kvserve.engine.engine import Engine, EngineStats
from kvserve.engine.logprobs import TokenLogprob
from kvserve.engine.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    PromptOutputs,
    RequestDelta,
    RequestOutput,
)
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.validation import CheckedPrompt
from kvserve.model.tokenizer import MessageDict


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


Prompt = str | TokensPrompt
Conversation = Sequence[MessageDict]


@dataclass
class _Run:
    """One prompt of a batch: its checked prompt, its samples' outputs as they fold, its latencies."""

    request_id: str
    text: str | None
    prompt: CheckedPrompt
    outputs: PromptOutputs
    metrics: dict[str, float] = field(default_factory=dict)


class LLM:
    """A model with its engine, for offline batches. Every prompt of a call runs in one continuous batch,
    and the prefix cache persists across calls: a later call reuses what earlier ones computed."""

    def __init__(self, model: str | None = None, **config: Any) -> None:
        self.engine = Engine.from_config(EngineConfig(model=model, **config))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def _tokens(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt["prompt_token_ids"])

    def chat_token_ids(self, messages: Conversation, namespace: str = "") -> list[int]:
        """A conversation's token ids, earlier replies spliced in as their generated ids (engine/chat.py)."""
        return encode_chat(self.tokenizer, self.engine.replies, messages, namespace)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, with `params.n` completions each; `params` is one for all prompts or a
        list with one per prompt."""
        batch = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        return self._run([self._tokens(p) for p in batch], params)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations; one output each."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self._run([(None, self.chat_token_ids(c)) for c in conversations], params)  # type: ignore[arg-type]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas as tokens are decoded."""
        _, ids = self._tokens(prompt)
        for delta in self.stream_deltas(ids, params):
            if delta.text:
                yield delta.text

    def stream_deltas(
        self, prompt_token_ids: list[int], params: SamplingParams | None = None
    ) -> Iterator[RequestDelta]:
        """Yield the request's deltas (tokens, text, cached-token counts) as they are decoded; closing the
        iterator early aborts the request."""
        rid = f"stream-{next(self._ids)}"
        self.engine.add_request(rid, prompt_token_ids, params or SamplingParams())
        try:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    if delta.request_id == rid:
                        yield delta
        finally:
            self.engine.abort_request(rid)

    def _params_per_prompt(
        self, count: int, params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[SamplingParams]:
        if params is None or isinstance(params, SamplingParams):
            return [params or SamplingParams()] * count
        if len(params) != count:
            raise ValueError(f"got {len(params)} SamplingParams for {count} prompts: one, or one per prompt")
        return list(params)

    def _run(
        self,
        prompts: list[tuple[str | None, list[int]]],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[RequestOutput]:
        """Every sample of every prompt in one continuous batch; the n samples of a prompt are n engine
        requests, which read the prompt's KV from the prefix cache once the first has computed it."""
        started = time.monotonic()
        per_prompt = self._params_per_prompt(len(prompts), params)
        # The one check: every prompt before any is queued, so a bad one leaves nothing running. Each
        # prompt is its own request: the cap on prompts x n is for one network request, not a batch.
        checked = [
            self.engine.validate_request([ids], p)[0] for (_, ids), p in zip(prompts, per_prompt, strict=True)
        ]
        runs: list[_Run] = []
        # Engine request id -> (its prompt's run, the sample's index).
        samples: dict[str, tuple[_Run, int]] = {}
        for (text, _), p, prompt in zip(prompts, per_prompt, checked, strict=True):
            run = _Run(str(next(self._ids)), text, prompt, PromptOutputs.start(len(prompt.token_ids), p.n))
            runs.append(run)
            for i in range(p.n):
                rid = run.request_id if p.n == 1 else f"{run.request_id}-{i}"
                self.engine.add_request(rid, prompt, p.for_sample(i))
                samples[rid] = (run, i)
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                if delta.request_id not in samples:
                    continue
                run, i = samples[delta.request_id]
                run.metrics.setdefault("first_token_latency", time.monotonic() - started)
                run.outputs.add(i, delta)
                if delta.finished and run.outputs.finished:
                    run.metrics["latency"] = time.monotonic() - started
        return [self._request_output(run) for run in runs]

    def _request_output(self, run: "_Run") -> RequestOutput:
        folded = run.outputs
        with_logprobs = run.prompt.params.logprobs is not None
        return RequestOutput(
            run.request_id,
            run.text,
            run.prompt.token_ids,
            [
                CompletionOutput(
                    i,
                    s.text,
                    s.token_ids,
                    s.finish_reason,
                    [self._position(lp) for lp in s.logprobs] if with_logprobs else None,
                )
                for i, s in enumerate(folded.samples)
            ],
            finished=folded.finished,
            num_cached_tokens=folded.num_cached_tokens,
            metrics=run.metrics,
            prompt_logprobs=(
                None
                if folded.prompt_logprobs is None
                else [None if lp is None else self._position(lp) for lp in folded.prompt_logprobs]
            ),
        )

    def _position(self, logprob: TokenLogprob) -> PositionLogprobs:
        """vLLM's shape: the top-k tokens with their ranks, and the chosen token with its own rank."""
        text = self.tokenizer.token_text
        position = {t: Logprob(v, rank, text(t)) for rank, (t, v) in enumerate(logprob.top, start=1)}
        position[logprob.token_id] = Logprob(logprob.logprob, logprob.rank, text(logprob.token_id))
        return position

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()

    def stats(self) -> EngineStats:
        return self.engine.stats()
