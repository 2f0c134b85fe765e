"""Offline API, shaped like vLLM's: LLM(model).generate(prompts, params) and LLM.chat(messages, params)."""

import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypedDict

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine, EngineStats
from kvserve.engine.logprobs import TokenLogprob
from kvserve.engine.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestDelta,
    RequestOutput,
)
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.tokenizer import ChatMessage


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


Prompt = str | TokensPrompt
Conversation = Sequence[ChatMessage]


class LLM:
    """A model with its engine, for offline batches. Every prompt of a call runs in one continuous batch,
    and the prefix cache persists across calls: a later call reuses what earlier ones computed."""

    def __init__(self, model: str | None = None, **config: Any) -> None:
        self.engine = Engine(EngineConfig(model=model, **config))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def _tokens(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt["prompt_token_ids"])

    def chat_token_ids(self, messages: Conversation, namespace: str = "") -> list[int]:
        return self.tokenizer.encode_chat(
            messages, known_reply=lambda text: self.engine.replies.lookup(namespace, text)
        )

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
        outputs: list[RequestOutput] = []
        # Engine request id -> (its prompt's output, the sample's index).
        samples: dict[str, tuple[RequestOutput, int]] = {}
        started = time.monotonic()
        per_prompt = self._params_per_prompt(len(prompts), params)
        # Every prompt is checked before any is queued, so a bad one leaves nothing running. Each prompt is
        # its own request: the cap on prompts x n is for one network request, not an offline batch.
        checked = [
            self.engine.validate_request([ids], p)[0] for (_, ids), p in zip(prompts, per_prompt, strict=True)
        ]
        for (text, _), p, prompt in zip(prompts, per_prompt, checked, strict=True):
            base = str(next(self._ids))
            out = RequestOutput(base, text, prompt.token_ids, [], finished=False)
            outputs.append(out)
            for i in range(p.n):
                rid = base if p.n == 1 else f"{base}-{i}"
                self.engine.add_request(rid, prompt, p.for_sample(i))
                logprobs: list[PositionLogprobs] | None = [] if p.logprobs is not None else None
                out.outputs.append(CompletionOutput(i, "", [], logprobs=logprobs))
                samples[rid] = (out, i)
        cached: dict[str, int] = {}
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                if delta.request_id not in samples:
                    continue
                out, i = samples[delta.request_id]
                completion = out.outputs[i]
                if "first_token_latency" not in out.metrics:
                    out.metrics["first_token_latency"] = time.monotonic() - started
                completion.text += delta.text
                completion.token_ids += delta.token_ids
                if completion.logprobs is not None:
                    completion.logprobs += [self._position(lp) for lp in delta.logprobs]
                if delta.prompt_logprobs is not None:
                    out.prompt_logprobs = [
                        None if lp is None else self._position(lp) for lp in delta.prompt_logprobs
                    ]
                # What was cached before the request: its samples after the first find the prompt cached.
                cached[delta.request_id] = delta.num_cached_tokens
                out.num_cached_tokens = min(c for r, c in cached.items() if samples[r][0] is out)
                if delta.finished:
                    completion.finish_reason = delta.finish_reason
                    out.finished = all(c.finish_reason is not None for c in out.outputs)
                    if out.finished:
                        out.metrics["latency"] = time.monotonic() - started
        return outputs

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
