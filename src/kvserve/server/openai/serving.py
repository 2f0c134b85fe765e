"""From a request plan to engine requests, and from engine deltas to OpenAI responses or SSE chunks.

Chat and text completions differ only in how their plan is built (server/core/plan.py) and how a choice is
shaped (an `OutputFormat`, server/openai/formats.py); several choices (n samples, batched prompts), streaming,
usage, latencies, disconnects and the per-choice log line are written once (one engine request's side
of them in server/core/generation.py, which the Responses API's writer shares).
"""

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing

from fastapi import Request, Response

from kvserve.engine.async_engine import Reservation
from kvserve.engine.logprobs import TokenLogprob
from kvserve.engine.outputs import RequestDelta
from kvserve.server.core.cache_report import CACHE_HEADER, CacheReport
from kvserve.server.core.context import ServerContext
from kvserve.server.core.generation import (
    EventStreamResponse,
    Generation,
    cancel_on_disconnect,
    remember_parts,
    report,
    run_all,
    start,
    usage,
)
from kvserve.server.core.output import OutputFormat, ResponseIds, TokenUsage
from kvserve.server.core.plan import RequestPlan
from kvserve.server.core.retention import retain_plan, written_tokens
from kvserve.server.http.errors import ErrorResponse, to_api_error

log = logging.getLogger("kvserve.server")


async def _merged(
    generations: Sequence[Generation],
) -> AsyncGenerator[tuple[Generation, RequestDelta], None]:
    """The deltas of every generation as they come; leaving early aborts those still running. One
    generation's deltas are read straight from its engine queue, with no pump between."""
    if len(generations) == 1:
        (g,) = generations
        async with aclosing(g.deltas()) as deltas:
            async for delta in deltas:
                yield g, delta
        return
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


async def _usage(
    ctx: ServerContext, plan: RequestPlan, generations: Sequence[Generation], cache: CacheReport | None
) -> TokenUsage:
    """The usage once the plan's breakpoints are held (after the reply, as Anthropic's are), with the
    cache report where the request asked for it."""
    kept = await retain_plan(ctx, plan)
    written = written_tokens(generations[0].choice, kept)
    return dataclasses.replace(usage(generations), cache_write_tokens=written, cache_report=cache)


def _sse(data: str) -> str:
    return f"data: {data}\n\n"


async def _events(
    ctx: ServerContext,
    request: Request,
    generations: Sequence[Generation],
    fmt: OutputFormat,
    ids: ResponseIds,
    include_usage: bool,
    plan: RequestPlan,
    cache: CacheReport | None,
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
        remember_parts(ctx, fmt.reply_part, generations, plan.namespace)
        counted = await _usage(ctx, plan, generations, cache)
        if include_usage:
            yield _sse(fmt.usage_chunk(ids, counted).model_dump_json())
    except Exception as exc:
        # The status line is long gone: the error can only travel as an event.
        error = to_api_error(request, exc)
        if error.status >= 500:
            log.exception("%s failed while streaming", ids.id)
        yield _sse(ErrorResponse(error=error.detail).model_dump_json())
    yield _sse("[DONE]")


async def respond(
    ctx: ServerContext,
    request: Request,
    fmt: OutputFormat,
    plan: RequestPlan,
    room: Reservation,
    stream: bool,
    include_usage: bool,
    cache_report: bool = False,
) -> Response:
    """Run the plan through the engine (`start`) and answer with every choice, whole or as a stream
    of chunks. A stream's last chunk carries the usage when `include_usage`; the usage carries the cache
    report when `cache_report`, and the CACHE_HEADER always."""
    ids, generations = await start(ctx, request, fmt.id_prefix, plan, room)
    try:
        figures = await report(ctx, plan, generations)
    except BaseException:
        for g in generations:
            await g.close()
        raise
    ctx.misses.answered(plan.namespace, ids.id, figures)
    cache = figures if cache_report else None
    if stream:
        events = _events(ctx, request, generations, fmt, ids, include_usage, plan, cache)
        response: Response = EventStreamResponse(events, generations)
    else:
        choices = await cancel_on_disconnect(request, run_all(generations))
        remember_parts(ctx, fmt.reply_part, generations, plan.namespace)
        result = fmt.response(ids, choices, await _usage(ctx, plan, generations, cache))
        response = Response(result.model_dump_json(), media_type="application/json")
    response.headers[CACHE_HEADER] = figures.header()
    return response
