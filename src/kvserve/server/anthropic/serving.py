"""A message plan through the engine, answered in Anthropic's shapes: a whole `message`, or its SSE events.

The generations are serving.py's (`start`, the same disconnect and abort handling); what differs is the
shape. A reply becomes content blocks: its think block (with a reasoning parser) a `thinking` block, its
calls (with tools) `tool_use` blocks whose `input` is the arguments parsed, the rest a `text` block. A
stream sends Anthropic's event sequence: `message_start` (with the prompt's usage), a `ping`, then per
block `content_block_start`, its deltas (`thinking_delta`, `text_delta`, `input_json_delta`) and
`content_block_stop`, then `message_delta` (stop reason and usage) and `message_stop`; a `ping` goes out
whenever no delta has come for `PING_INTERVAL_S`, and an error after the status line is an `error` event.

Usage splits the prompt in three: `cache_read_input_tokens` (what the prefix cache held), then
`cache_creation_input_tokens` (what this request's breakpoints kept past that: the prefix their
retentions hold, in whole blocks and within the tenant's budget), then `input_tokens` (the rest); they
add up to the prompt. A stream's `message_start` goes out before the retention is made, so its figure
is the most the breakpoints could keep; `message_delta`, whose usage clients take as final, counts what
was kept.

`cache_creation` splits the created tokens by the TTL of the breakpoint that keeps them (an hour or
more: `ephemeral_1h_input_tokens`, less: `ephemeral_5m_input_tokens`). A request that sends
`diagnostics` gets Anthropic's cache diagnosis in the message (`diagnosis`), and every answer the
x-kvserve-cache header (server/core/cache_report.py).

A pre-warm (max_tokens 0) runs the same path: the prompt is computed, its blocks published and its
breakpoints retained; the answer has no content blocks (a stream none between `message_start` and
`message_delta`), stop_reason `max_tokens`, and the usage of the write.
"""

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request, Response

from kvserve.cache.cache_miss import MISS_DIVERGED
from kvserve.cache.retention import MAX_RETENTION_TTL_S
from kvserve.engine.async_engine import Reservation
from kvserve.engine.outputs import RequestDelta
from kvserve.model.tokenizer import Tokenizer
from kvserve.server.anthropic.errors import anthropic_error
from kvserve.server.anthropic.protocol import AnthropicUsage, DiagnosticsRequest, MessageResponse
from kvserve.server.core import harmony
from kvserve.server.core.cache_report import CACHE_HEADER, NO_MISS, PART_SYSTEM, PART_TOOLS, CacheReport
from kvserve.server.core.context import ServerContext
from kvserve.server.core.generation import (
    EventStreamResponse,
    Generation,
    cancel_on_disconnect,
    remember_parts,
    report,
    run_all,
    start,
)
from kvserve.server.core.harmony import HarmonyStream
from kvserve.server.core.output import Choice
from kvserve.server.core.plan import RequestPlan
from kvserve.server.core.reasoning import ReasoningStream, split
from kvserve.server.core.retention import retain_breakpoints
from kvserve.server.core.tool_formats.layout import ParsedCall
from kvserve.server.core.tool_formats.syntax import CallStreamer, CallSyntax
from kvserve.server.http.errors import to_api_error

log = logging.getLogger("kvserve.server")

# A stream with nothing to say for this long sends a `ping`, so that proxies and clients see it alive.
PING_INTERVAL_S = 10.0


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _input(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as its `input` object; None for anything that is not an object."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


@dataclass(frozen=True)
class MessagesFormat:
    """How this request's replies are read: the call syntax of its tools (None without tools), the
    tools' names, whether think blocks are split off (`reasoning`) and whether the prompt opened one,
    and the stop sequences, to name the one a reply stopped at."""

    tokenizer: Tokenizer
    layout: CallSyntax | None
    tool_names: frozenset[str] | None
    reasoning: bool
    opened: bool
    stop_sequences: tuple[str, ...]
    # A harmony chat's replies (server/core/harmony.py): channels, not think blocks and layouts.
    harmony: bool = False

    def reply_part(self, choice: Choice) -> str | tuple[str, ...] | None:
        """What of a reasoning reply comes back as the next turn's text: the content after its block; a
        harmony reply's keys."""
        if self.harmony:
            channels = harmony.reply(choice.text, self.tool_names)
            prompt = choice.prompt.token_ids
            return tuple(
                harmony.reply_key(prompt, channels.content, channels.calls, r)
                for r in (channels.reasoning, None)
            )
        if not self.reasoning:
            return None
        parts = split(choice.text, self.opened)
        return parts.content if parts.reasoning is not None and parts.content else None

    def stop(self, choice: Choice, calls: bool) -> tuple[str, str | None]:
        """Anthropic's stop_reason and stop_sequence of a finished reply."""
        if choice.finish_reason == "length":
            return "max_tokens", None
        if calls:
            return "tool_use", None
        if choice.finish_reason == "stop" and self.stop_sequences:
            # The text is cut before the stop sequence; the ids hold it still.
            whole = self.tokenizer.decode(choice.output.token_ids, skip_special_tokens=True)
            rest = whole[len(choice.text) :]
            for s in self.stop_sequences:
                if rest.startswith(s):
                    return "stop_sequence", s
        return "end_turn", None

    def calls(self, text: str, finish_reason: str | None) -> list[ParsedCall] | None:
        """The reply's calls (None if it is text), as chat reads them: all of a finished reply, the
        complete ones of a reply cut short while calling."""
        if self.layout is None:
            return None
        if finish_reason == "stop":
            calls = self.layout.parse_calls(text, self.tool_names)
        elif finish_reason == "length" and self.layout.is_call_text(text):
            calls = self.layout.complete_calls(text)
        else:
            return None
        if calls is not None and any(_input(c.arguments) is None for c in calls):
            return None
        return calls

    def content(self, choice: Choice) -> tuple[list[dict[str, Any]], bool]:
        """A finished reply's content blocks, and whether it made tool calls."""
        text = choice.text
        blocks: list[dict[str, Any]] = []
        if self.harmony:
            channels = harmony.reply(text, self.tool_names)
            if channels.reasoning is not None:
                blocks.append({"type": "thinking", "thinking": channels.reasoning, "signature": ""})
            if channels.content:
                blocks.append({"type": "text", "text": channels.content})
            for c in channels.calls:
                blocks.append(
                    {"type": "tool_use", "id": _tool_id(), "name": c.name, "input": _input(c.arguments)}
                )
            return blocks or [{"type": "text", "text": ""}], bool(channels.calls)
        if self.reasoning:
            parts = split(text, self.opened)
            if parts.reasoning is not None:
                blocks.append({"type": "thinking", "thinking": parts.reasoning, "signature": ""})
            text = parts.content
        calls = self.calls(text, choice.finish_reason)
        if calls is not None and self.layout is not None:
            lead = self.layout.lead(text)
            if lead:
                blocks.append({"type": "text", "text": lead})
            for c in calls:
                blocks.append(
                    {"type": "tool_use", "id": _tool_id(), "name": c.name, "input": _input(c.arguments)}
                )
        elif text:
            blocks.append({"type": "text", "text": text})
        if not blocks:
            blocks.append({"type": "text", "text": ""})
        return blocks, bool(calls)


# Kept prefixes as (tokens held, TTL in seconds), one per breakpoint, shortest first.
Held = Sequence[tuple[int, float]]


def anthropic_usage(choice: Choice, held: Held) -> AnthropicUsage:
    """The prompt's usage, where the breakpoints' retentions hold `held`: each breakpoint's prefix kept
    for its TTL, the tokens past the one before it created for that TTL."""
    prompt = choice.outputs.num_prompt_tokens
    read = choice.outputs.num_cached_tokens
    by_ttl = {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}
    start = read
    for tokens, ttl_s in held:
        end = min(tokens, prompt)
        if end > start:
            key = "ephemeral_1h_input_tokens" if ttl_s >= MAX_RETENTION_TTL_S else "ephemeral_5m_input_tokens"
            by_ttl[key] += end - start
            start = end
    created = sum(by_ttl.values())
    return AnthropicUsage(
        input_tokens=prompt - read - created,
        output_tokens=choice.output.num_output_tokens,
        cache_creation_input_tokens=created,
        cache_read_input_tokens=read,
        cache_creation=by_ttl,
    )


def diagnosis(
    ctx: ServerContext, namespace: str, asked: DiagnosticsRequest, figures: CacheReport
) -> dict[str, Any]:
    """Anthropic's `diagnostics` of a message: `cache_miss_reason` null where nothing was missed (or on
    a first turn, `previous_message_id` null), `previous_message_not_found` for an id this namespace was
    not answered lately (another tenant's included), `system_changed`, `tools_changed` or
    `messages_changed` with `cache_missed_input_tokens` for a prompt that parts from what was seen, and
    `unavailable` for text lost from the cache (evicted, expired, ...: the prompt did not change); the
    engine's own figures ride along as `kvserve_cache_report`."""
    reason: dict[str, Any] | None = None
    previous = asked.previous_message_id
    if previous is not None and not ctx.misses.known(namespace, previous):
        reason = {"type": "previous_message_not_found"}
    elif previous is not None and figures.reason == MISS_DIVERGED:
        kind = {PART_SYSTEM: "system_changed", PART_TOOLS: "tools_changed"}.get(
            figures.part or "", "messages_changed"
        )
        reason = {"type": kind, "cache_missed_input_tokens": figures.missed_tokens}
    elif previous is not None and figures.reason != NO_MISS:
        reason = {"type": "unavailable"}
    return {"cache_miss_reason": reason, "kvserve_cache_report": figures.as_dict()}


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=True)}\n\n"


@dataclass
class _Blocks:
    """The content blocks of a streamed reply: one open at a time, numbered as they open."""

    index: int = -1
    kind: str | None = None
    calls: int = 0
    opened_any: bool = field(default=False)

    def open(self, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index += 1
        self.kind = block["type"]
        self.opened_any = True
        return [*events, _event("content_block_start", {"index": self.index, "content_block": block})]

    def delta(self, kind: str, delta: dict[str, Any]) -> str:
        return _event("content_block_delta", {"index": self.index, "delta": {"type": kind, **delta}})

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"index": self.index})]


@dataclass
class _ReplyStream:
    """One reply's text deltas as content-block events."""

    fmt: MessagesFormat
    blocks: _Blocks = field(default_factory=_Blocks)
    reasoning: ReasoningStream | None = None
    calls: CallStreamer | None = None
    channels: HarmonyStream | None = None

    def __post_init__(self) -> None:
        if self.fmt.harmony:
            self.channels = HarmonyStream(self.fmt.tool_names)
            return
        self.reasoning = ReasoningStream(self.fmt.opened) if self.fmt.reasoning else None
        self.calls = self.fmt.layout.stream() if self.fmt.layout is not None else None

    def _harmony(self, channels: HarmonyStream, text: str, finished: bool) -> list[str]:
        delta = channels.push(text, finished)
        events: list[str] = []
        thought = delta.get("reasoning_content", "")
        if thought:
            if self.blocks.kind != "thinking":
                events += self.blocks.open({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self.blocks.delta("thinking_delta", {"thinking": thought}))
        events += self._text(delta.get("content", ""))
        for entry in delta.get("tool_calls", ()):
            name = entry["function"]["name"]
            events += self.blocks.open({"type": "tool_use", "id": _tool_id(), "name": name, "input": {}})
            events.append(
                self.blocks.delta("input_json_delta", {"partial_json": entry["function"]["arguments"]})
            )
        return events

    def push(self, text: str, finished: bool) -> list[str]:
        if self.channels is not None:
            return self._harmony(self.channels, text, finished)
        thought, body = ("", text) if self.reasoning is None else self.reasoning.push(text)
        if finished and self.reasoning is not None:
            more_thought, more_body = self.reasoning.finish()
            thought += more_thought
            body += more_body
        events: list[str] = []
        if thought:
            if self.blocks.kind != "thinking":
                events += self.blocks.open({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self.blocks.delta("thinking_delta", {"thinking": thought}))
        if body:
            events += self._body(body)
        if finished and self.calls is not None:
            events += self._text(self.calls.finish())
        return events

    def _body(self, text: str) -> list[str]:
        if self.calls is None:
            return self._text(text)
        delta = self.calls.push(text)
        events = self._text(delta.get("content", ""))
        for entry in delta.get("tool_calls", ()):
            if "id" in entry:
                name = entry["function"]["name"]
                events += self.blocks.open({"type": "tool_use", "id": _tool_id(), "name": name, "input": {}})
            piece = entry["function"]["arguments"]
            if piece:
                events.append(self.blocks.delta("input_json_delta", {"partial_json": piece}))
        return events

    def _text(self, text: str) -> list[str]:
        if not text:
            return []
        events = [] if self.blocks.kind == "text" else self.blocks.open({"type": "text", "text": ""})
        return [*events, self.blocks.delta("text_delta", {"text": text})]

    def end(self) -> list[str]:
        events = [] if self.blocks.opened_any else self.blocks.open({"type": "text", "text": ""})
        return events + self.blocks.close()

    @property
    def made_calls(self) -> bool:
        if self.channels is not None:
            return self.channels.num_calls > 0
        return self.calls is not None and self.calls.num_calls > 0


async def _deltas_with_pings(g: Generation) -> AsyncGenerator[RequestDelta | None, None]:
    """The generation's deltas, and None whenever PING_INTERVAL_S passes without one. The pending
    read is waited on, never cancelled: cancelling it would abort the request."""
    async with aclosing(g.deltas()) as deltas:
        while True:
            task = asyncio.ensure_future(anext(deltas, None))
            try:
                while not task.done():
                    await asyncio.wait((task,), timeout=PING_INTERVAL_S)
                    if not task.done():
                        yield None
            finally:
                if not task.done():
                    task.cancel()
                    with suppress(asyncio.CancelledError):
                        await task
            delta = task.result()
            if delta is None:
                return
            yield delta


async def _events(
    ctx: ServerContext,
    request: Request,
    plan: RequestPlan,
    g: Generation,
    fmt: MessagesFormat,
    message_id: str,
    diagnostics: dict[str, Any] | None,
) -> AsyncGenerator[str, None]:
    reply = _ReplyStream(fmt)
    try:
        most = [(ctx.async_engine.retainable_length(b.tokens), b.ttl_s) for b in plan.breakpoints]
        usage = anthropic_usage(g.choice, most)
        message = MessageResponse(
            id=message_id,
            model=ctx.model_name,
            content=[],
            stop_reason=None,
            usage=usage,
            diagnostics=diagnostics,
        ).model_dump()
        yield _event("message_start", {"message": message})
        yield _event("ping", {})
        async with aclosing(_deltas_with_pings(g)) as deltas:
            async for delta in deltas:
                if delta is None:
                    yield _event("ping", {})
                    continue
                for event in reply.push(delta.text, delta.finished):
                    yield event
        # A pre-warm (max_tokens 0) has no content block, not even an empty one.
        for event in [] if plan.prewarm else reply.end():
            yield event
        remember_parts(ctx, fmt.reply_part, [g], plan.namespace)
        stop_reason, stop_sequence = fmt.stop(g.choice, reply.made_calls)
        held = await _retain(ctx, plan)
        yield _event(
            "message_delta",
            {
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": anthropic_usage(g.choice, held).model_dump(),
            },
        )
        yield _event("message_stop", {})
    except Exception as exc:
        # The status line is long gone: the error can only travel as an event.
        error = to_api_error(request, exc)
        if error.status >= 500:
            log.exception("%s failed while streaming", message_id)
        yield _event("error", {"error": anthropic_error(error)["error"]})


async def _retain(ctx: ServerContext, plan: RequestPlan) -> Held:
    """Hold each breakpoint's prefix once the reply is out (while it ran, its own sequence held the
    prompt's blocks, and an engine call before its first token would have delayed that token by a
    step); returns how many of the prompt's first tokens each breakpoint's retention now holds, with
    its TTL."""
    breakpoints = [(b.tokens, b.ttl_s) for b in plan.breakpoints]
    held = await retain_breakpoints(ctx, plan.namespace, plan.prompts[0].token_ids, breakpoints)
    return list(zip(held, (b.ttl_s for b in plan.breakpoints), strict=True))


async def respond_messages(
    ctx: ServerContext,
    request: Request,
    fmt: MessagesFormat,
    plan: RequestPlan,
    room: Reservation,
    stream: bool,
    diagnose: DiagnosticsRequest | None = None,
) -> Response:
    """Run a message plan (one prompt, one sample) and answer in Anthropic's shape, with its cache
    diagnosis when `diagnose` (the request's `diagnostics`)."""
    ids, generations = await start(ctx, request, "msg", plan, room)
    (g,) = generations
    try:
        figures = await report(ctx, plan, generations)
    except BaseException:
        await g.close()
        raise
    diagnostics = None if diagnose is None else diagnosis(ctx, plan.namespace, diagnose, figures)
    ctx.misses.answered(plan.namespace, ids.id, figures)
    if stream:
        events = _events(ctx, request, plan, g, fmt, ids.id, diagnostics)
        response: Response = EventStreamResponse(events, generations)
        response.headers[CACHE_HEADER] = figures.header()
        return response
    choices: Sequence[Choice] = await cancel_on_disconnect(request, run_all(generations))
    remember_parts(ctx, fmt.reply_part, generations, plan.namespace)
    held = await _retain(ctx, plan)
    (choice,) = choices
    content, calls = ([], False) if plan.prewarm else fmt.content(choice)
    stop_reason, stop_sequence = fmt.stop(choice, calls)
    result = MessageResponse(
        id=ids.id,
        model=ctx.model_name,
        content=content,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=anthropic_usage(choice, held),
        diagnostics=diagnostics,
    )
    headers = {CACHE_HEADER: figures.header()}
    return Response(result.model_dump_json(), media_type="application/json", headers=headers)
