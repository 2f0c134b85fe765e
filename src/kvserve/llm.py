"""Offline API, shaped like vLLM's: LLM(model).generate(prompts, params) and LLM.chat(messages, params)."""

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, TypedDict

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine, EngineStats
from kvserve.engine.outputs import CompletionOutput, RequestDelta, RequestOutput
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
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        batch = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        return self._run([self._tokens(p) for p in batch], params or SamplingParams())

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations; one output each."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self._run([(None, self.chat_token_ids(c)) for c in conversations], params or SamplingParams())  # type: ignore[arg-type]

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

    def _run(
        self, prompts: list[tuple[str | None, list[int]]], params: SamplingParams
    ) -> list[RequestOutput]:
        outputs: dict[str, RequestOutput] = {}
        order: list[str] = []
        started = time.monotonic()
        for text, ids in prompts:
            rid = str(next(self._ids))
            self.engine.add_request(rid, ids, replace(params))
            order.append(rid)
            outputs[rid] = RequestOutput(rid, text, ids, [CompletionOutput(0, "", [])], finished=False)
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                out = outputs.get(delta.request_id)
                if out is None:
                    continue
                completion = out.outputs[0]
                if not completion.token_ids:
                    out.metrics["first_token_latency"] = time.monotonic() - started
                completion.text += delta.text
                completion.token_ids += delta.token_ids
                out.num_cached_tokens = delta.num_cached_tokens
                if delta.finished:
                    completion.finish_reason = delta.finish_reason
                    out.finished = True
                    out.metrics["latency"] = time.monotonic() - started
        return [outputs[rid] for rid in order]

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()

    def stats(self) -> EngineStats:
        return self.engine.stats()
