"""One engine request as the server sees it (`Generation`: its deltas, latencies, usage and log line),
a client's hang-up cancelling it, and the event stream that closes it: and a plan's
generations started together (`start`): what the chat and completions writer (server/openai/serving.py), the
Responses writer (server/responses/serving.py) and the Messages writer (server/anthropic/serving.py)
share.
"""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from contextlib import suppress
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvserve.engine.async_engine import Reservation
from kvserve.engine.outputs import PromptOutputs, RequestDelta
from kvserve.engine.sampling_params import SamplingParams
from kvserve.server.core import harmony
from kvserve.server.core.cache_report import NO_MISS, CacheReport, cache_report, miss_record
from kvserve.server.core.context import ServerContext
from kvserve.server.core.output import Choice, ResponseIds, TokenUsage
from kvserve.server.core.plan import RequestPlan
from kvserve.server.http.errors import ClientDisconnected
from kvserve.server.http.metrics import RequestTimer

log = logging.getLogger("kvserve.server")

T = TypeVar("T")


class Generation:
    """One engine request (one choice) as the server sees it: its deltas, latencies and log line. The
    deltas fold into its choice's prompt outputs, which usage and the response read. Its sequence is
    taken from `room`, its request's reservation, when it starts."""

    def __init__(
        self,
        ctx: ServerContext,
        log_id: str,
        engine_id: str,
        choice: Choice,
        params: SamplingParams,
        namespace: str,
        room: Reservation,
        checkpoints: Sequence[int] = (),
    ) -> None:
        """`checkpoints`: prompt positions where a hybrid model should keep its state (the request's
        cache breakpoints and its reply turn's start: `RequestPlan.state_checkpoints`)."""
        self.log_id = log_id
        self.choice = choice
        self._metrics = ctx.metrics
        self.tenant = room.tenant
        self._timer = RequestTimer(ctx.metrics)
        # Closing this generator is what aborts the request.
        self._deltas = ctx.async_engine.generate(
            choice.prompt.checked, params, namespace, engine_id, room.tenant, room, checkpoints
        )
        self._first: RequestDelta | None = None
        self._ended = False

    async def start(self) -> None:
        """Wait for the first delta. A request the engine refuses (full queue) raises here, while the
        HTTP status can still say so."""
        try:
            self._first = self._observe(await anext(self._deltas))
            output = self.choice.output
            self._metrics.tenant_prefix_cache(
                self.tenant, self.choice.outputs.num_prompt_tokens, output.num_cached_tokens or 0
            )
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
        self.choice.outputs.add(self.choice.sample, delta)
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
        output = self.choice.output
        log.info(
            "%s: prompt %d tokens (%d cached), %d completion tokens, finish %s, ttft %s, total %.3fs",
            self.log_id,
            self.choice.outputs.num_prompt_tokens,
            output.num_cached_tokens or 0,
            output.num_output_tokens,
            reason,
            "-" if ttft is None else f"{ttft:.3f}s",
            elapsed,
        )


def usage(generations: Sequence[Generation]) -> TokenUsage:
    """Each prompt counts once however many samples share it, with its cached tokens (what was cached
    before the request: see PromptOutputs)."""
    prompts = list({id(g.choice.outputs): g.choice.outputs for g in generations}.values())
    prompt_tokens = sum(p.num_prompt_tokens for p in prompts)
    completion_tokens = sum(g.choice.output.num_output_tokens for g in generations)
    return TokenUsage(prompt_tokens, completion_tokens, sum(p.num_cached_tokens for p in prompts))


async def report(ctx: ServerContext, plan: RequestPlan, generations: Sequence[Generation]) -> CacheReport:
    """The request's cache report once every generation has its first delta (cache_report.py): its
    prompts' figures summed, the first miss's reason and place. A miss goes into its namespace's log.
    Naming a diverged miss's part renders the chat again: a preparation job of the caller's tenant."""
    prompts = list({id(g.choice.outputs): g.choice for g in generations}.values())
    tokenizer = ctx.async_engine.tokenizer
    reports = []
    for choice in prompts:
        miss = choice.outputs.cache_miss
        token_ids = choice.prompt.token_ids
        if miss is not None and plan.parts is not None:
            one = await ctx.preparation.run(
                generations[0].tenant, cache_report, choice.outputs, token_ids, plan.parts, tokenizer
            )
        else:
            one = cache_report(choice.outputs, token_ids, None, tokenizer)
        if one.reason != NO_MISS:
            shown = tokenizer if ctx.options.dashboard_show_text else None
            ctx.misses.record(plan.namespace, miss_record(one, time.time(), token_ids, shown))
        reports.append(one)
    first = next((r for r in reports if r.reason != NO_MISS), reports[0])
    return CacheReport(
        sum(r.cached_tokens for r in reports),
        sum(r.missed_tokens for r in reports),
        first.reason,
        first.position,
        first.part,
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


def remember_parts(
    ctx: ServerContext,
    reply_part: Callable[[Choice], str | tuple[str, ...] | None],
    generations: Sequence[Generation],
    namespace: str,
) -> None:
    """Tell the reply memory which finished replies come back to their clients as a part (the content
    after a think block, or a harmony reply's keys), so that a later turn that renders the block again
    reads their KV."""
    eos = ctx.async_engine.tokenizer.eos_token_ids
    for g in generations:
        part = reply_part(g.choice) if g.choice.finish_reason is not None else None
        for p in (part,) if isinstance(part, str) else part or ():
            if harmony.is_reply_key(p):
                # Keyed by its prompt, so the reply's own ids: the same text written in other tokens
                # elsewhere is another reply. The stop token that ended it was never run.
                ids = g.choice.output.token_ids
                ids = ids[:-1] if g.choice.finish_reason == "stop" and ids and ids[-1] in eos else ids
                ctx.async_engine.remember_reply(namespace, p, ids, g.tenant)
            else:
                ctx.async_engine.remember_reply_part(namespace, p, g.choice.text, g.tenant)


async def start_all(generations: Sequence[Generation]) -> None:
    """Wait for every generation's first delta; if one fails, abort them all and raise its error. A
    refused request is one line in the log (its error's), not one per sequence."""
    results = await asyncio.gather(*(g.start() for g in generations), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        for g in generations:
            await g.close(log_line=False)
        raise errors[0]


async def run_all(generations: Sequence[Generation]) -> list[Choice]:
    return list(await asyncio.gather(*(g.run() for g in generations)))


async def start(
    ctx: ServerContext, request: Request, id_prefix: str, plan: RequestPlan, room: Reservation
) -> tuple[ResponseIds, list[Generation]]:
    """Submit the plan's samples of each of its prompts to the engine and wait for each one's first
    delta. The samples of a prompt are submitted together, so all but the first read its KV from the
    prefix cache instead of computing it again. `room` is the engine's room for them, reserved by the
    route before any work: each takes its sequence from it as it is queued."""
    ids = ResponseIds(f"{id_prefix}-{uuid.uuid4().hex}", int(time.time()), ctx.model_name)
    log_id: str = getattr(request.state, "request_id", ids.id)
    many = len(plan.prompts) * plan.n > 1
    generations = []
    for i, prompt in enumerate(plan.prompts):
        outputs = PromptOutputs.start(len(prompt.token_ids), plan.n)
        for j, sample in enumerate(plan.samples):
            index = i * plan.n + j
            generations.append(
                Generation(
                    ctx,
                    f"{log_id}[{index}]" if many else log_id,
                    f"{ids.id}-{index}",
                    Choice(index, prompt, outputs, j),
                    sample,
                    plan.namespace,
                    room,
                    plan.state_checkpoints if len(plan.prompts) == 1 else (),
                )
            )
    await cancel_on_disconnect(request, start_all(generations))
    return ids, generations
