"""From an OpenAI request to engine input, and from engine deltas to OpenAI responses or SSE chunks.

Chat and text completions differ only in how the prompt is built and how a choice is shaped (an
`OutputFormat`, server/formats.py); several choices (n samples, batched prompts), streaming, usage,
latencies, disconnects and the per-choice log line are written once.
"""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Coroutine, Sequence
from contextlib import aclosing, suppress
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request, Response
from jinja2 import TemplateError
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.engine.logprobs import TokenLogprob
from kvserve.engine.outputs import RequestDelta
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.validation import CheckedPrompt
from kvserve.errors import InvalidRequestError
from kvserve.model.tokenizer import Tokenizer
from kvserve.options import ServerOptions
from kvserve.server.auth import caller
from kvserve.server.errors import APIError, ClientDisconnected, ErrorResponse, to_api_error
from kvserve.server.formats import Choice, OutputFormat, PromptInput, ResponseIds
from kvserve.server.limits import InFlightLimiter, PromptGuard, Reservation, SequenceAdmission
from kvserve.server.metrics import RequestTimer, ServerMetrics
from kvserve.server.protocol import ChatMessage, PromptTokensDetails, SamplingRequest, Usage
from kvserve.server.structured import structured_outputs
from kvserve.server.tenants import Tenants
from kvserve.server.tools import ToolUse, conversation

log = logging.getLogger("kvserve.server")

T = TypeVar("T")


@dataclass(frozen=True)
class ServerContext:
    """What every route needs: the engine, the served model's name and limits, metrics, the tenants
    (with the admin key) and the server's options. `admission` holds room in the engine's queue for
    whole requests."""

    async_engine: AsyncEngine
    model_name: str
    max_model_len: int
    metrics: ServerMetrics
    tenants: Tenants
    created: int
    in_flight: InFlightLimiter
    prompt_guard: PromptGuard
    admission: SequenceAdmission
    max_sequences_per_request: int
    options: ServerOptions


def check_model(ctx: ServerContext, model: str | None) -> None:
    """A request may name the served model or none at all; any other name is a 404, as OpenAI answers."""
    if model and model != ctx.model_name:
        raise APIError(
            404,
            f"The model '{model}' does not exist; this server serves '{ctx.model_name}' (GET /v1/models).",
            param="model",
            code="model_not_found",
        )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise InvalidRequestError("logit_bias keys must be token ids", "logit_bias") from None


def sampling_params(
    body: SamplingRequest,
    max_tokens: int | None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
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
        include_stop_str_in_output=body.include_stop_str_in_output,
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        skip_special_tokens=body.skip_special_tokens,
        n=body.n,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=_logit_bias(body.logit_bias),
        structured_outputs=structured_outputs(body),
    )


def chat_prompt(
    ctx: ServerContext,
    messages: list[ChatMessage],
    namespace: str,
    add_generation_prompt: bool = True,
    tools: ToolUse | None = None,
) -> list[int]:
    """Token ids of a conversation (with its tools, calls and results in the generic format of
    server/tools.py); earlier replies of this engine come back as their exact ids, so the next turn of
    a chat finds its whole history in the prefix cache."""
    ctx.prompt_guard.check([m.text for m in messages], "messages")
    engine = ctx.async_engine.engine
    try:
        return engine.tokenizer.encode_chat(
            conversation(messages, tools),
            add_generation_prompt,
            known_reply=lambda text: engine.replies.lookup(namespace, text),
        )
    except (ValueError, TemplateError) as e:
        raise InvalidRequestError(f"The chat template cannot render these messages: {e}", "messages") from e


def text_prompt(tokenizer: Tokenizer, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
    return tokenizer.encode(prompt, add_special_tokens) if isinstance(prompt, str) else list(prompt)


def check_token_ids(vocab: int, batch: Sequence[str | Sequence[int]], param: str = "prompt") -> None:
    """Token ids a client sends must be in [0, vocab) before anything reads them: the tokenizer cannot
    decode, nor a cache key pack, what is out of range."""
    if any(not isinstance(p, str) and any(not 0 <= t < vocab for t in p) for p in batch):
        raise APIError(400, f"Prompt token ids must be in [0, {vocab}).", param=param)


CompletionPrompt = str | list[int] | list[str] | list[list[int]]


def prompt_batch(prompt: CompletionPrompt) -> list[str | list[int]]:
    """A completions `prompt` as a batch: one text or token-id list, or a batch of either."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) or not prompt:
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def completion_prompts(tokenizer: Tokenizer, prompt: CompletionPrompt) -> list[PromptInput]:
    """Each prompt of a completions `prompt` with its echo text."""
    batch = prompt_batch(prompt)
    # Checked before the echo text is decoded from them.
    check_token_ids(tokenizer.vocab_size, batch)
    return [
        PromptInput(text_prompt(tokenizer, p), p if isinstance(p, str) else tokenizer.decode(p, False))
        for p in batch
    ]


class Generation:
    """One engine request (one choice) as the server sees it: its deltas, usage, latencies and log line."""

    def __init__(
        self,
        ctx: ServerContext,
        log_id: str,
        engine_id: str,
        choice: Choice,
        prompt: CheckedPrompt,
        params: SamplingParams,
        namespace: str,
        tenant: str,
    ) -> None:
        self.log_id = log_id
        self.choice = choice
        self._metrics = ctx.metrics
        self._tenant = tenant
        self._timer = RequestTimer(ctx.metrics)
        # Closing this generator is what aborts the request.
        self._deltas = ctx.async_engine.generate(prompt, params, namespace, engine_id, tenant)
        self._first: RequestDelta | None = None
        self._ended = False
        self.num_prompt_tokens = len(choice.prompt.token_ids)
        self.num_cached_tokens = 0
        self.num_output_tokens = 0

    async def start(self) -> None:
        """Wait for the first delta. A request the engine refuses (full queue) raises here, while the
        HTTP status can still say so."""
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

    async def close(self, log_line: bool = True) -> None:
        """Abort the request unless it has finished; closing twice is harmless. `log_line=False` when
        the whole request is refused, which its error logs once."""
        await self._deltas.aclose()
        self._end(log_line)

    async def run(self) -> Choice:
        """Run to the end; the choice then holds the whole text and logprobs."""
        async for _ in self.deltas():
            pass
        return self.choice

    def _observe(self, delta: RequestDelta) -> RequestDelta:
        self._timer.tokens(len(delta.token_ids))
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        self.num_output_tokens = delta.num_output_tokens
        self.choice.text += delta.text
        self.choice.logprobs += delta.logprobs
        if delta.prompt_logprobs is not None:
            self.choice.prompt_logprobs = delta.prompt_logprobs
        self.choice.finish_reason = delta.finish_reason
        return delta

    def _end(self, log_line: bool = True) -> None:
        if self._ended:
            return
        self._ended = True
        reason = self.choice.finish_reason or "abort"
        elapsed = self._timer.elapsed()
        if self.choice.finish_reason is not None:
            self._metrics.e2e_latency.observe(elapsed)
        self._metrics.finished(reason)
        if not log_line:
            return
        ttft = self._timer.ttft
        log.info(
            "%s: prompt %d tokens (%d cached), %d completion tokens, finish %s, ttft %s, total %.3fs",
            self.log_id,
            self.num_prompt_tokens,
            self.num_cached_tokens,
            self.num_output_tokens,
            reason,
            "-" if ttft is None else f"{ttft:.3f}s",
            elapsed,
        )


def usage(generations: Sequence[Generation]) -> Usage:
    """Each prompt counts once however many samples share it; its cached tokens are what was cached
    before the request (the fewest any of its samples found)."""
    prompts: dict[int, tuple[int, int]] = {}
    for g in generations:
        key = id(g.choice.prompt)
        tokens, cached = prompts.get(key, (g.num_prompt_tokens, g.num_cached_tokens))
        prompts[key] = (tokens, min(cached, g.num_cached_tokens))
    prompt_tokens = sum(t for t, _ in prompts.values())
    completion_tokens = sum(g.num_output_tokens for g in generations)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(c for _, c in prompts.values())),
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


async def _merged(
    generations: Sequence[Generation],
) -> AsyncGenerator[tuple[Generation, RequestDelta], None]:
    """The deltas of every generation as they come; leaving early aborts those still running."""
    queue: asyncio.Queue[tuple[Generation, RequestDelta | BaseException | None]] = asyncio.Queue()

    async def pump(g: Generation) -> None:
        try:
            async for delta in g.deltas():
                queue.put_nowait((g, delta))
        except Exception as e:
            queue.put_nowait((g, e))
        finally:
            queue.put_nowait((g, None))

    tasks = [asyncio.ensure_future(pump(g)) for g in generations]
    try:
        running = len(tasks)
        while running:
            g, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield g, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _sse(data: str) -> str:
    return f"data: {data}\n\n"


async def _events(
    request: Request,
    generations: Sequence[Generation],
    fmt: OutputFormat,
    ids: ResponseIds,
    include_usage: bool,
) -> AsyncGenerator[str, None]:
    # OpenAI's chunks carry "usage": null until the last one when usage is asked for, and no key otherwise.
    exclude = None if include_usage else {"usage"}
    # Logprobs of tokens whose text is held back (a possible stop string) wait for the next chunk.
    pending: dict[int, list[TokenLogprob]] = {g.choice.index: [] for g in generations}
    try:
        for opening in fmt.opening(ids, [g.choice for g in generations]):
            yield _sse(opening.model_dump_json(exclude=exclude))
        async with aclosing(_merged(generations)) as deltas:
            async for g, delta in deltas:
                held = pending[g.choice.index]
                held += delta.logprobs
                if delta.text or delta.finished:
                    chunk = fmt.chunk(ids, g.choice, delta.text, held, delta.finish_reason)
                    yield _sse(chunk.model_dump_json(exclude=exclude))
                    held.clear()
        if include_usage:
            yield _sse(fmt.usage_chunk(ids, usage(generations)).model_dump_json())
    except Exception as exc:
        # The status line is long gone: the error can only travel as an event.
        error = to_api_error(request, exc)
        if error.status >= 500:
            log.exception("%s failed while streaming", ids.id)
        yield _sse(ErrorResponse(error=error.detail).model_dump_json())
    yield _sse("[DONE]")


class EventStreamResponse(StreamingResponse):
    """Server-sent events of one response, closed the moment the response ends, however it ends.

    Starlette leaves a generator that it stopped iterating (client gone, shutdown) to the garbage
    collector; closing it here aborts the engine requests right away.
    """

    def __init__(self, events: AsyncGenerator[str, None], generations: Sequence[Generation]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._events = events
        self._generations = generations

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
            # Also covers an event generator that was never started.
            for g in self._generations:
                await g.close()


async def _start_all(generations: Sequence[Generation], room: Reservation) -> None:
    """Wait for every generation's first delta; if one fails, abort them all and raise its error.

    `room` is handed back once every sequence is counted in the engine's queue, not at its first delta:
    held through a prefill, it would count each sequence twice and turn away requests that fit. A
    refused request is one line in the log (its error's), not one per sequence."""
    starts = [asyncio.ensure_future(g.start()) for g in generations]
    # One turn of the loop runs each start up to its first wait for a delta, by which point
    # AsyncEngine.generate has counted its sequence in flight (or refused it).
    await asyncio.sleep(0)
    room.release()
    results = await asyncio.gather(*starts, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for g in generations:
            await g.close(log_line=False)
        raise errors[0]


async def _run_all(generations: Sequence[Generation]) -> list[Choice]:
    return list(await asyncio.gather(*(g.run() for g in generations)))


def _validated_samples(
    engine: Engine, prompts: Sequence[PromptInput], params: SamplingParams, prompt_param: str
) -> tuple[list[CheckedPrompt], list[SamplingParams]]:
    """The checked prompts, and the params of each of the n samples, built once and shared by every
    prompt: what can never run is refused before anything is queued."""
    try:
        checked = engine.validate_request([p.token_ids for p in prompts], params)
    except InvalidRequestError as e:
        if e.param != "prompt":
            raise
        raise InvalidRequestError(e.message, prompt_param) from None
    return checked, [params.for_sample(j) for j in range(params.n)]


async def respond(
    ctx: ServerContext,
    request: Request,
    fmt: OutputFormat,
    prompts: Sequence[PromptInput],
    params: SamplingParams,
    namespace: str,
    body: SamplingRequest,
    room: Reservation,
) -> Response:
    """Run `params.n` samples of each prompt through the engine and answer with every choice, whole or
    as a stream of chunks. The samples of a prompt are submitted together, so all but the first read
    its KV from the prefix cache instead of computing it again. `room` is the engine's room for them,
    taken by the route before any work; it is handed back once they are in the engine."""
    ids = ResponseIds(f"{fmt.id_prefix}-{uuid.uuid4().hex}", int(time.time()), ctx.model_name)
    log_id: str = getattr(request.state, "request_id", ids.id)
    tenant = caller(request).tenant.name
    # Validation reads every prompt token and the bias of each sample: off the event loop.
    checked, samples = await asyncio.to_thread(
        _validated_samples, ctx.async_engine.engine, prompts, params, fmt.prompt_param
    )
    many = len(prompts) * params.n > 1
    generations = []
    for i, prompt in enumerate(prompts):
        for j, sample in enumerate(samples):
            index = i * params.n + j
            generations.append(
                Generation(
                    ctx,
                    f"{log_id}[{index}]" if many else log_id,
                    f"{ids.id}-{index}",
                    Choice(index, prompt),
                    checked[i],
                    sample,
                    namespace,
                    tenant,
                )
            )
    try:
        await cancel_on_disconnect(request, _start_all(generations, room))
    finally:
        room.release()
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return EventStreamResponse(_events(request, generations, fmt, ids, include_usage), generations)
    choices = await cancel_on_disconnect(request, _run_all(generations))
    result = fmt.response(ids, choices, usage(generations))
    return Response(result.model_dump_json(), media_type="application/json")
