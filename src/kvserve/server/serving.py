"""From an OpenAI request to engine input, and from engine deltas to OpenAI responses or SSE chunks.

Chat and text completions differ only in how the prompt is built and how a choice is shaped (an
`OutputFormat`); streaming, usage, latencies, disconnects and the per-request log line are written once.
"""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Coroutine
from contextlib import aclosing, suppress
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fastapi import Request, Response
from jinja2 import TemplateError
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.outputs import RequestDelta
from kvserve.engine.sampling_params import SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.model.tokenizer import Tokenizer
from kvserve.server.auth import caller
from kvserve.server.errors import APIError, ClientDisconnected, ErrorResponse, to_api_error
from kvserve.server.limits import InFlightLimiter, PromptGuard
from kvserve.server.metrics import RequestTimer, ServerMetrics
from kvserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatMessage,
    CompletionChoice,
    CompletionResponse,
    PromptTokensDetails,
    SamplingRequest,
    Usage,
)
from kvserve.server.tenants import Tenants

log = logging.getLogger("kvserve.server")

T = TypeVar("T")


@dataclass(frozen=True)
class ServerContext:
    """What every route needs: the engine, the served model's name and limits, metrics and the tenants."""

    async_engine: AsyncEngine
    model_name: str
    max_model_len: int
    metrics: ServerMetrics
    tenants: Tenants
    created: int
    in_flight: InFlightLimiter
    prompt_guard: PromptGuard


def check_model(ctx: ServerContext, model: str | None) -> None:
    """A request may name the served model or none at all; any other name is a 404, as OpenAI answers."""
    if model and model != ctx.model_name:
        raise APIError(
            404,
            f"The model '{model}' does not exist; this server serves '{ctx.model_name}' (GET /v1/models).",
            param="model",
            code="model_not_found",
        )


def sampling_params(body: SamplingRequest, max_tokens: int | None) -> SamplingParams:
    """OpenAI's defaults for unset values; SamplingParams raises InvalidRequestError on a bad one."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        min_p=0.0 if body.min_p is None else body.min_p,
        seed=body.seed,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        n=body.n,
    )


def chat_prompt(
    ctx: ServerContext, messages: list[ChatMessage], namespace: str, add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of a conversation; earlier replies of this engine come back as their exact ids, so the
    next turn of a chat finds its whole history in the prefix cache."""
    ctx.prompt_guard.check([m.text for m in messages], "messages")
    engine = ctx.async_engine.engine
    conversation = [{"role": m.role, "content": m.text} for m in messages]
    try:
        return engine.tokenizer.encode_chat(
            conversation,
            add_generation_prompt,
            known_reply=lambda text: engine.replies.lookup(namespace, text),
        )
    except (ValueError, TemplateError) as e:
        raise InvalidRequestError(f"The chat template cannot render these messages: {e}", "messages") from e


def text_prompt(tokenizer: Tokenizer, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
    return tokenizer.encode(prompt, add_special_tokens) if isinstance(prompt, str) else list(prompt)


@dataclass(frozen=True)
class ResponseIds:
    """What every chunk of one response repeats."""

    id: str
    created: int
    model: str


class OutputFormat(Protocol):
    id_prefix: str
    prompt_param: str

    def opening(self, ids: ResponseIds) -> BaseModel | None: ...

    def chunk(self, ids: ResponseIds, text: str, finish_reason: str | None) -> BaseModel: ...

    def usage_chunk(self, ids: ResponseIds, usage: Usage) -> BaseModel: ...

    def response(self, ids: ResponseIds, text: str, finish_reason: str | None, usage: Usage) -> BaseModel: ...


class ChatFormat:
    id_prefix = "chatcmpl"
    prompt_param = "messages"

    def opening(self, ids: ResponseIds) -> BaseModel | None:
        # OpenAI's first chunk names the role and nothing else.
        return self._chunk(ids, [ChatChunkChoice(delta={"role": "assistant", "content": ""})])

    def chunk(self, ids: ResponseIds, text: str, finish_reason: str | None) -> BaseModel:
        delta = {"content": text} if text else {}
        return self._chunk(ids, [ChatChunkChoice(delta=delta, finish_reason=finish_reason)])

    def usage_chunk(self, ids: ResponseIds, usage: Usage) -> BaseModel:
        return self._chunk(ids, [], usage)

    def response(self, ids: ResponseIds, text: str, finish_reason: str | None, usage: Usage) -> BaseModel:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)
        return ChatCompletionResponse(
            id=ids.id, created=ids.created, model=ids.model, choices=[choice], usage=usage
        )

    @staticmethod
    def _chunk(
        ids: ResponseIds, choices: list[ChatChunkChoice], usage: Usage | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=ids.id, created=ids.created, model=ids.model, choices=choices, usage=usage
        )


class CompletionFormat:
    id_prefix = "cmpl"
    prompt_param = "prompt"

    def opening(self, ids: ResponseIds) -> BaseModel | None:
        return None

    def chunk(self, ids: ResponseIds, text: str, finish_reason: str | None) -> BaseModel:
        return self._response(ids, [CompletionChoice(text=text, finish_reason=finish_reason)])

    def usage_chunk(self, ids: ResponseIds, usage: Usage) -> BaseModel:
        return self._response(ids, [], usage)

    def response(self, ids: ResponseIds, text: str, finish_reason: str | None, usage: Usage) -> BaseModel:
        return self._response(ids, [CompletionChoice(text=text, finish_reason=finish_reason)], usage)

    @staticmethod
    def _response(
        ids: ResponseIds, choices: list[CompletionChoice], usage: Usage | None = None
    ) -> CompletionResponse:
        return CompletionResponse(
            id=ids.id, created=ids.created, model=ids.model, choices=choices, usage=usage
        )


class Generation:
    """One engine request as the server sees it: its deltas, usage, latencies and log line."""

    def __init__(
        self,
        ctx: ServerContext,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        namespace: str,
        tenant: str,
    ) -> None:
        self.request_id = request_id
        self._metrics = ctx.metrics
        self._tenant = tenant
        self._timer = RequestTimer(ctx.metrics)
        # Closing this generator is what aborts the request.
        self._deltas = ctx.async_engine.generate(prompt_token_ids, params, namespace, request_id)
        self._first: RequestDelta | None = None
        self._ended = False
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.finish_reason: str | None = None

    async def start(self) -> None:
        """Wait for the first token. A request the engine refuses (bad input, full queue) raises here,
        while the HTTP status can still say so."""
        try:
            self._first = self._observe(await anext(self._deltas))
            self._metrics.tenant_prefix_cache(self._tenant, self.num_prompt_tokens, self.num_cached_tokens)
        except asyncio.CancelledError:
            self._end()
            raise

    async def deltas(self) -> AsyncGenerator[RequestDelta, None]:
        """The deltas from the first on; leaving early (or being cancelled) aborts the request at once."""
        try:
            if self._first is not None:
                yield self._first
            async for delta in self._deltas:
                yield self._observe(delta)
        finally:
            await self.close()

    async def close(self) -> None:
        """Abort the request unless it has finished; closing twice is harmless."""
        await self._deltas.aclose()
        self._end()

    async def text(self) -> str:
        return "".join([delta.text async for delta in self.deltas()])

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_output_tokens,
            total_tokens=self.num_prompt_tokens + self.num_output_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.num_cached_tokens),
        )

    def _observe(self, delta: RequestDelta) -> RequestDelta:
        self._timer.tokens(len(delta.token_ids))
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        self.num_output_tokens = delta.num_output_tokens
        self.finish_reason = delta.finish_reason
        return delta

    def _end(self) -> None:
        if self._ended:
            return
        self._ended = True
        reason = self.finish_reason or "abort"
        elapsed = self._timer.elapsed()
        if self.finish_reason is not None:
            self._metrics.e2e_latency.observe(elapsed)
        self._metrics.finished(reason)
        ttft = self._timer.ttft
        log.info(
            "%s: prompt %d tokens (%d cached), %d completion tokens, finish %s, ttft %s, total %.3fs",
            self.request_id,
            self.num_prompt_tokens,
            self.num_cached_tokens,
            self.num_output_tokens,
            reason,
            "-" if ttft is None else f"{ttft:.3f}s",
            elapsed,
        )


async def _disconnected(request: Request) -> None:
    # The body has been read, so the only message left to receive is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Run work, cancelling it if the client hangs up first; cancelling a generation aborts it and frees
    its KV blocks, instead of computing tokens that nobody will read."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()
    if not task.done() or task.cancelled():
        with suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnected
    return task.result()


def _sse(data: str) -> str:
    return f"data: {data}\n\n"


async def _events(
    request: Request,
    generation: Generation,
    fmt: OutputFormat,
    ids: ResponseIds,
    include_usage: bool,
) -> AsyncGenerator[str, None]:
    # OpenAI's chunks carry "usage": null until the last one when usage is asked for, and no key otherwise.
    exclude = None if include_usage else {"usage"}
    try:
        opening = fmt.opening(ids)
        if opening is not None:
            yield _sse(opening.model_dump_json(exclude=exclude))
        async with aclosing(generation.deltas()) as deltas:
            async for delta in deltas:
                if delta.text or delta.finished:
                    yield _sse(
                        fmt.chunk(ids, delta.text, delta.finish_reason).model_dump_json(exclude=exclude)
                    )
        if include_usage:
            yield _sse(fmt.usage_chunk(ids, generation.usage()).model_dump_json())
    except Exception as exc:
        # The status line is long gone: the error can only travel as an event.
        error = to_api_error(request, exc)
        if error.status >= 500:
            log.exception("%s failed while streaming", generation.request_id)
        yield _sse(ErrorResponse(error=error.detail).model_dump_json())
    yield _sse("[DONE]")


class EventStreamResponse(StreamingResponse):
    """Server-sent events of one generation, closed the moment the response ends, however it ends.

    Starlette leaves a generator that it stopped iterating (client gone, shutdown) to the garbage
    collector; closing it here aborts the engine request right away.
    """

    def __init__(self, events: AsyncGenerator[str, None], generation: Generation) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._events = events
        self._generation = generation

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
            # Also covers an event generator that was never started.
            await self._generation.close()


async def respond(
    ctx: ServerContext,
    request: Request,
    fmt: OutputFormat,
    prompt_token_ids: list[int],
    params: SamplingParams,
    namespace: str,
    body: SamplingRequest,
) -> Response:
    """Run one request through the engine and answer it whole, or as a stream of chunks."""
    ids = ResponseIds(f"{fmt.id_prefix}-{uuid.uuid4().hex}", int(time.time()), ctx.model_name)
    generation = Generation(ctx, ids.id, prompt_token_ids, params, namespace, caller(request).tenant.name)
    try:
        await cancel_on_disconnect(request, generation.start())
    except InvalidRequestError as e:
        if e.param != "prompt":
            raise
        raise InvalidRequestError(e.message, fmt.prompt_param) from None
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return EventStreamResponse(_events(request, generation, fmt, ids, include_usage), generation)
    text = await cancel_on_disconnect(request, generation.text())
    result = fmt.response(ids, text, generation.finish_reason, generation.usage())
    return Response(result.model_dump_json(), media_type="application/json")
