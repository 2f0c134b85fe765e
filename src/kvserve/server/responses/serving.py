"""POST /v1/responses: a Responses plan through the engine, answered whole or as semantic events, and
stored for `previous_response_id` when `store` is on.

The reply is parsed as chat's is (server/core/output.py:ReplyParser: think block, tool calls in the
server's format), then shaped as Responses output items: a `reasoning` item, then either `function_call` items
(arguments: the exact text generated), `custom_tool_call` items for the custom tools (input: the string
the model wrote as the one argument they are offered with, server/responses/convert.py), or one `message`
with its `output_text`. A stream sends OpenAI's events, each with an increasing `sequence_number`:
response.created, response.in_progress, then for each item output_item.added, its parts and deltas
(reasoning_text, output_text, function_call_arguments) and their .done events (a custom tool call's
input comes whole, as one response.custom_tool_call_input.delta and its .done, when the call ends),
output_item.done, and last response.completed (response.incomplete when cut at max_output_tokens). A
pre-warm (max_output_tokens 0) has no output item, whole or streamed. A
stored response keeps the conversation with its reply and the exact token ids
(server/responses/store.py); a stream is stored once it has ended whole. The response is written to JSON
once, off the event loop when stored: the POST (or the stream's last event) answers those bytes, and a
GET answers the same bytes.
"""

import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request, Response
from pydantic import BaseModel

from kvserve.cache.cache_miss import MISS_DIVERGED
from kvserve.engine.async_engine import Reservation
from kvserve.engine.outputs import PromptOutputs
from kvserve.errors import InvalidRequestError
from kvserve.server.core.cache_report import CACHE_HEADER, NO_MISS, PART_TOOLS, CacheReport
from kvserve.server.core.context import ServerContext
from kvserve.server.core.generation import (
    EventStreamResponse,
    Generation,
    cancel_on_disconnect,
    remember_parts,
    report,
    usage,
)
from kvserve.server.core.messages import ChatMessage, FunctionCall, ToolCall
from kvserve.server.core.output import Choice, ReplyParser
from kvserve.server.core.prompts import Continuation
from kvserve.server.core.retention import retain_plan, written_tokens
from kvserve.server.core.tool_formats.stream import new_call_id
from kvserve.server.core.tools import conversation
from kvserve.server.http.errors import APIError, to_api_error
from kvserve.server.responses.convert import (
    PreviousResponse,
    ResponsesPlan,
    custom_input,
    response_tool_choice,
    response_tools,
    responses_plan,
)
from kvserve.server.responses.protocol import (
    CustomToolCallItem,
    FunctionCallItem,
    IncompleteDetails,
    InputItemList,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from kvserve.server.responses.store import ResponseStore, StoredResponse, new_response_id

log = logging.getLogger("kvserve.server")


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def unknown_response(response_id: str) -> APIError:
    """The one answer for an id this tenant has no response under (unknown, expired, deleted, or
    another tenant's: they are not told apart)."""
    return APIError(
        404,
        f"No response with id {response_id[:64]!r} is stored for this key.",
        param="response_id",
        code="response_not_found",
    )


def previous_response(store: ResponseStore, tenant: str, response_id: str | None) -> PreviousResponse | None:
    if response_id is None:
        return None
    stored = store.get(tenant, response_id)
    if stored is None:
        raise APIError(
            404,
            f"previous_response_id {response_id[:64]!r} names no response stored for this key (unknown, "
            "expired, deleted, or made with store false).",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    replay = stored.read_replay()
    continuation = None
    if replay.continuation_content is not None:
        continuation = Continuation(
            stored.continuation_ids(), replay.continuation_content, replay.continuation_lead or ""
        )
    return PreviousResponse(tuple(replay.messages), continuation)


def prepare(
    ctx: ServerContext, store: ResponseStore, body: ResponsesRequest, namespace: str, tenant: str
) -> ResponsesPlan:
    """The previous response read and the plan built, in one trip off the event loop."""
    return responses_plan(ctx, body, namespace, previous_response(store, tenant, body.previous_response_id))


def _call_item(call: FunctionCallItem, custom: frozenset[str]) -> FunctionCallItem | CustomToolCallItem:
    """A call as its output item: a custom tool's as a custom_tool_call with its free text."""
    if call.name not in custom:
        return call
    return CustomToolCallItem(
        id=call.id,
        call_id=call.call_id,
        name=call.name,
        input=custom_input(call.arguments),
        status=call.status,
    )


@dataclass
class _Reply:
    """A reply as output items grow: its reasoning, its text and its calls (each as the function call
    the model wrote; `custom` names those answered as custom_tool_call items)."""

    custom: frozenset[str] = frozenset()
    reasoning: ReasoningItem | None = None
    message: OutputMessage | None = None
    calls: list[FunctionCallItem] = field(default_factory=list)

    def items(self) -> list[OutputItem]:
        out: list[OutputItem] = [] if self.reasoning is None else [self.reasoning]
        if self.message is not None:
            out.append(self.message)
        return [*out, *(_call_item(c, self.custom) for c in self.calls)]

    def assistant(self) -> ChatMessage:
        """The reply as the conversation's next assistant message."""
        return ChatMessage(
            role="assistant",
            content=self.message.content[0].text if self.message is not None else None,
            tool_calls=[
                ToolCall(id=c.call_id, function=FunctionCall(name=c.name, arguments=c.arguments))
                for c in self.calls
            ]
            or None,
            reasoning_content=self.reasoning.content[0].text if self.reasoning is not None else None,
        )


class _Run:
    """One request's generation and what its response and its stored copy are made of."""

    def __init__(
        self,
        ctx: ServerContext,
        store: ResponseStore,
        request: Request,
        body: ResponsesRequest,
        prepared: ResponsesPlan,
    ) -> None:
        self.ctx = ctx
        self.store = store
        self.body = body
        self.prepared = prepared
        self.id = new_response_id()
        self.created = int(time.time())
        plan = prepared.plan
        self.parser = ReplyParser(
            plan.call_syntax,
            ctx.chat.reasoning,
            plan.opens_reasoning,
            plan.tool_names,
            ctx.chat.harmony,
        )
        (prompt,) = plan.prompts
        self.choice = Choice(0, prompt, PromptOutputs.start(len(prompt.token_ids), 1), 0)
        self.log_id: str = getattr(request.state, "request_id", self.id)
        # The prompt's first tokens this request's cache breakpoints hold, once its reply is out.
        self.kept = 0
        # Its prompt_cache_diagnostics, when asked for (`diagnosis`).
        self.diagnostics: dict[str, Any] | None = None

    def generation(self, room: Reservation) -> Generation:
        plan = self.prepared.plan
        return Generation(
            self.ctx,
            self.log_id,
            self.id,
            self.choice,
            plan.samples[0],
            plan.namespace,
            room,
            plan.state_checkpoints,
        )

    def response(self, reply: _Reply, generation: Generation | None, status: str) -> ResponseObject:
        body = self.body
        text_format: dict[str, Any] = {"type": "text"}
        if body.text is not None and body.text.format is not None:
            text_format = body.text.format.model_dump(by_alias=True, exclude_none=True)
        finish = self.choice.finish_reason
        return ResponseObject(
            id=self.id,
            created_at=self.created,
            status=status,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if finish == "length" else None,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            model=self.ctx.model_name,
            output=reply.items(),
            parallel_tool_calls=body.parallel_tool_calls,
            previous_response_id=body.previous_response_id,
            reasoning={
                "effort": body.reasoning.effort if body.reasoning else None,
                "summary": body.reasoning.summary if body.reasoning else None,
            },
            store=body.store,
            temperature=body.temperature,
            text={"format": text_format},
            tool_choice=response_tool_choice(body.tool_choice),
            tools=list(self.prepared.response_tools),
            top_p=body.top_p,
            usage=None if generation is None else self._usage(generation, reply),
            user=body.user,
            metadata=dict(body.metadata or {}),
            prompt_cache_diagnostics=self.diagnostics,
        )

    def _usage(self, generation: Generation, reply: _Reply) -> ResponseUsage:
        counted = usage([generation])
        reasoning = reply.reasoning.content[0].text if reply.reasoning is not None else ""
        reasoning_tokens = len(self.ctx.async_engine.tokenizer.encode(reasoning, False)) if reasoning else 0
        return ResponseUsage(
            input_tokens=counted.prompt_tokens,
            input_tokens_details=InputTokensDetails(
                cached_tokens=counted.cached_tokens, cache_write_tokens=written_tokens(self.choice, self.kept)
            ),
            output_tokens=counted.completion_tokens,
            output_tokens_details=OutputTokensDetails(
                reasoning_tokens=min(reasoning_tokens, counted.completion_tokens)
            ),
            total_tokens=counted.prompt_tokens + counted.completion_tokens,
        )

    def remember(self, generation: Generation) -> None:
        """A harmony reply's keys in the reply memory: its next turn (by previous_response_id or sent
        whole) splices it back as its own ids (server/core/harmony.py)."""
        if self.ctx.chat.harmony:
            parts = self.parser.reply_part
            remember_parts(
                self.ctx,
                lambda c: parts(c.text, c.prompt.token_ids),
                [generation],
                self.prepared.plan.namespace,
            )

    def status(self) -> str:
        return "incomplete" if self.choice.finish_reason == "length" else "completed"

    async def answer(self, response: ResponseObject, reply: _Reply, tenant: str) -> bytes:
        """The response's JSON, and the response kept for GET and previous_response_id when `store` is on:
        then the JSON, the stored copy and the disk's fsync or Redis' round trip are made off the event
        loop, as a preparation job of its tenant, and a GET answers these very bytes."""
        if not self.body.store:
            return response.model_dump_json().encode()
        return await self.ctx.preparation.run(tenant, self._store, response, reply, tenant)

    def _store(self, response: ResponseObject, reply: _Reply, tenant: str) -> bytes:
        """Its conversation with the reply appended, and its exact ids when the reply's ids stand for
        its text, kept; the response's JSON as kept."""
        assistant = reply.assistant()
        # A pre-warm has no reply: the conversation it keeps ends with its input.
        prewarm = self.prepared.plan.prewarm
        messages = [*self.prepared.messages] if prewarm else [*self.prepared.messages, assistant]
        stored = StoredResponse(
            id=self.id,
            tenant=tenant,
            expires_at=self.store.expiry(),
            response=response,
            input_items=input_items(self.body),
            messages=messages,
        )
        continuation = None if prewarm else self._continuation(assistant)
        if continuation is not None:
            stored.continuation_ids = list(continuation.ids)
            stored.continuation_content = continuation.content
            stored.continuation_lead = continuation.lead
        return self.store.put(stored)

    def _continuation(self, assistant: ChatMessage) -> Continuation | None:
        """The prompt's and the reply's ids, with the text they stand for before the reply's content as
        its assistant message renders (a think block, for a reasoning reply)."""
        output = self.choice.output
        text = output.text
        ids = list(output.token_ids)
        sample = self.prepared.plan.samples[0]
        tokenizer = self.ctx.async_engine.tokenizer
        stops = {*tokenizer.eos_token_ids, *sample.stop_token_ids}
        if ids and output.finish_reason == "stop" and ids[-1] in stops:
            # The reply is its tokens but the stop token that ended it, which the template writes itself.
            ids = ids[:-1]
        if tokenizer.decode(ids, sample.skip_special_tokens) != text or self.ctx.chat.harmony:
            # A harmony reply goes back through the reply memory (`remember`).
            return None
        (turn,) = conversation([assistant], None, self.ctx.chat.tools)
        content = turn["content"]
        if not content or not text.endswith(content):
            return None
        lead = self.prepared.prompt_text + text[: len(text) - len(content)]
        return Continuation(tuple(self.choice.prompt.token_ids + ids), content, lead)


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items with ids (GET /v1/responses/{id}/input_items)."""
    if isinstance(body.input, str):
        part = {"type": "input_text", "text": body.input}
        return [{"id": _item_id("msg"), "type": "message", "role": "user", "content": [part]}]
    items = []
    for item in body.input:
        data = item.model_dump(exclude_none=True, exclude={"tools"})
        if item.tools is not None:
            # An additional_tools item's tools as a response lists them: only what was offered.
            data["tools"] = response_tools(item.tools)
        data.setdefault("type", "message")
        data.setdefault("id", _item_id("item"))
        items.append(data)
    return items


def item_list(
    store: ResponseStore, tenant: str, response_id: str, limit: int, order: str, after: str | None
) -> bytes | None:
    """A page of the tenant's stored response's input items as an InputItemList's JSON (None when it
    has no such response), read and written off the event loop."""
    stored = store.get(tenant, response_id)
    if stored is None:
        return None
    input_items = stored.read_replay().input_items
    items = input_items if order == "asc" else input_items[::-1]
    if after is not None:
        ids = [i.get("id") for i in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[:limit]
    return (
        InputItemList(
            data=page,
            first_id=page[0].get("id") if page else None,
            last_id=page[-1].get("id") if page else None,
            has_more=len(items) > limit,
        )
        .model_dump_json()
        .encode()
    )


def _whole_reply(run: _Run) -> _Reply:
    """The finished reply's items, parsed whole (as a chat completion's: server/core/output.py)."""
    reply = _Reply(run.prepared.custom_tools)
    if run.prepared.plan.prewarm:
        return reply
    parsed = run.parser.whole(run.choice.text, run.choice.finish_reason)
    if parsed.reasoning is not None:
        reply.reasoning = ReasoningItem(id=_item_id("rs"), content=[ReasoningText(text=parsed.reasoning)])
    for call in parsed.calls or ():
        reply.calls.append(
            FunctionCallItem(
                id=_item_id("fc"), call_id=new_call_id(), name=call.name, arguments=call.arguments
            )
        )
    if parsed.content is not None or not reply.calls:
        reply.message = OutputMessage(id=_item_id("msg"), content=[OutputText(text=parsed.content or "")])
    return reply


class _EventWriter:
    """A reply's chat chunk deltas (reasoning, content, tool_calls) as Responses events, numbered."""

    def __init__(self, custom: frozenset[str]) -> None:
        self.sequence = 0
        self.reply = _Reply(custom)
        # The item now open: its output index and kind ("reasoning", "message" or "call").
        self._open: str | None = None

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=True)}\n\n"

    def event_with(self, kind: str, key: str, data: bytes) -> str:
        """An event whose `key` is the JSON `data` as it stands (a stored response's very bytes)."""
        head = json.dumps({"type": kind, "sequence_number": self.sequence}, ensure_ascii=True)
        self.sequence += 1
        return f"event: {kind}\ndata: {head[:-1]}, {json.dumps(key)}: {data.decode()}}}\n\n"

    def _index(self) -> int:
        return len(self.reply.items()) - 1

    @staticmethod
    def _dump(item: BaseModel) -> dict[str, Any]:
        return item.model_dump()

    def delta(self, delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        reasoning = delta.get("reasoning_content")
        if reasoning:
            if self._open != "reasoning":
                out += self.close()
                self.reply.reasoning = ReasoningItem(
                    id=_item_id("rs"), content=[ReasoningText(text="")], status="in_progress"
                )
                self._open = "reasoning"
                out.append(self._added(self.reply.reasoning))
                out.append(self._part_added(self.reply.reasoning.id, {"type": "reasoning_text", "text": ""}))
            item = self.reply.reasoning
            assert item is not None
            item.content[0].text += reasoning
            out.append(self._text_delta("response.reasoning_text.delta", item.id, reasoning))
        content = delta.get("content")
        if content:
            if self._open != "message":
                out += self.close()
                self.reply.message = OutputMessage(
                    id=_item_id("msg"), content=[OutputText(text="")], status="in_progress"
                )
                self._open = "message"
                added = self.reply.message.model_copy(update={"content": []})
                out.append(self._added(added))
                out.append(self._part_added(self.reply.message.id, OutputText(text="").model_dump()))
            message = self.reply.message
            assert message is not None
            message.content[0].text += content
            out.append(self._text_delta("response.output_text.delta", message.id, content, logprobs=[]))
        for entry in delta.get("tool_calls", ()):
            if "id" in entry:
                out += self.close()
                call = FunctionCallItem(
                    id=_item_id("fc"),
                    call_id=entry["id"],
                    name=entry["function"]["name"],
                    arguments="",
                    status="in_progress",
                )
                self.reply.calls.append(call)
                self._open = "call"
                out.append(self._added(_call_item(call, self.reply.custom)))
            piece = entry.get("function", {}).get("arguments", "")
            if piece and self.reply.calls:
                call = self.reply.calls[-1]
                call.arguments += piece
                if call.name in self.reply.custom:
                    # Its free text is known once the arguments' JSON string has ended (close).
                    continue
                out.append(
                    self.event(
                        "response.function_call_arguments.delta",
                        item_id=call.id,
                        output_index=self._index(),
                        delta=piece,
                    )
                )
        return out

    def _added(self, item: BaseModel) -> str:
        return self.event("response.output_item.added", output_index=self._index(), item=self._dump(item))

    def _part_added(self, item_id: str, part: dict[str, Any]) -> str:
        return self.event(
            "response.content_part.added",
            item_id=item_id,
            output_index=self._index(),
            content_index=0,
            part=part,
        )

    def _text_delta(self, kind: str, item_id: str, text: str, **more: Any) -> str:
        return self.event(
            kind, item_id=item_id, output_index=self._index(), content_index=0, delta=text, **more
        )

    def close(self) -> list[str]:
        """The .done events of the item now open."""
        kind, self._open = self._open, None
        index = self._index()
        if kind == "reasoning" and self.reply.reasoning is not None:
            item = self.reply.reasoning
            item.status = "completed"
            part = item.content[0]
            return [
                self.event(
                    "response.reasoning_text.done",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    text=part.text,
                ),
                self.event(
                    "response.content_part.done",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    part=part.model_dump(),
                ),
                self.event("response.output_item.done", output_index=index, item=self._dump(item)),
            ]
        if kind == "message" and self.reply.message is not None:
            message = self.reply.message
            message.status = "completed"
            text = message.content[0]
            return [
                self.event(
                    "response.output_text.done",
                    item_id=message.id,
                    output_index=index,
                    content_index=0,
                    text=text.text,
                    logprobs=[],
                ),
                self.event(
                    "response.content_part.done",
                    item_id=message.id,
                    output_index=index,
                    content_index=0,
                    part=text.model_dump(),
                ),
                self.event("response.output_item.done", output_index=index, item=self._dump(message)),
            ]
        if kind == "call" and self.reply.calls:
            call = self.reply.calls[-1]
            call.status = "completed"
            if call.name in self.reply.custom:
                custom = _call_item(call, self.reply.custom)
                assert isinstance(custom, CustomToolCallItem)
                return [
                    self.event(
                        "response.custom_tool_call_input.delta",
                        item_id=custom.id,
                        output_index=index,
                        delta=custom.input,
                    ),
                    self.event(
                        "response.custom_tool_call_input.done",
                        item_id=custom.id,
                        output_index=index,
                        input=custom.input,
                    ),
                    self.event("response.output_item.done", output_index=index, item=self._dump(custom)),
                ]
            return [
                self.event(
                    "response.function_call_arguments.done",
                    item_id=call.id,
                    output_index=index,
                    name=call.name,
                    arguments=call.arguments,
                ),
                self.event("response.output_item.done", output_index=index, item=self._dump(call)),
            ]
        return []


async def _events(
    run: _Run, request: Request, generation: Generation, tenant: str
) -> AsyncGenerator[str, None]:
    writer = _EventWriter(run.prepared.custom_tools)
    opening = run.response(_Reply(), None, "in_progress").model_dump()
    yield writer.event("response.created", response=opening)
    yield writer.event("response.in_progress", response=opening)
    try:
        async with aclosing(generation.deltas()) as deltas:
            async for delta in deltas:
                if delta.text or delta.finished:
                    piece, _ = run.parser.delta(0, delta.text, delta.finish_reason)
                    for event in writer.delta(piece):
                        yield event
        for event in writer.close():
            yield event
        if writer.reply.message is None and not writer.reply.calls and not run.prepared.plan.prewarm:
            # An empty reply is still one message, as the whole response has (a pre-warm has none).
            writer.reply.message = OutputMessage(id=_item_id("msg"), content=[OutputText(text="")])
        run.remember(generation)
        run.kept = await retain_plan(run.ctx, run.prepared.plan)
        response = run.response(writer.reply, generation, run.status())
        data = await run.answer(response, writer.reply, tenant)
        kind = "response.completed" if response.status == "completed" else "response.incomplete"
        yield writer.event_with(kind, "response", data)
    except Exception as exc:
        error = to_api_error(request, exc)
        if error.status >= 500:
            log.exception("%s failed while streaming", run.id)
        yield writer.event(
            "error", code=error.detail.code, message=error.detail.message, param=error.detail.param
        )


def comparison_id(body: ResponsesRequest) -> str | None:
    """`prompt_cache_options.comparison_response_id`, when the request names one."""
    options = body.prompt_cache_options
    if not isinstance(options, dict) or options.get("comparison_response_id") is None:
        return None
    value = options["comparison_response_id"]
    if not isinstance(value, str):
        raise InvalidRequestError(
            "prompt_cache_options.comparison_response_id must be a string",
            "prompt_cache_options.comparison_response_id",
        )
    return value


def diagnosis(ctx: ServerContext, namespace: str, compared: str, figures: CacheReport) -> dict[str, Any]:
    """OpenAI's `prompt_cache_diagnostics`: `comparison_response_not_found` for an id this namespace was
    not answered lately (another tenant's included), `cache_miss` with `tools_changed` or
    `input_changed` and `cache_missed_tokens` for a prompt that parts from what was seen, `unavailable`
    for text lost from the cache (evicted, expired, ...: the prompt did not change), `cache_hit`
    otherwise; the engine's own figures ride along as `kvserve_cache_report`."""
    out: dict[str, Any]
    if not ctx.misses.known(namespace, compared):
        out = {"type": "comparison_response_not_found"}
    elif figures.reason == MISS_DIVERGED:
        reason = "tools_changed" if figures.part == PART_TOOLS else "input_changed"
        out = {"type": "cache_miss", "reason": reason, "cache_missed_tokens": figures.missed_tokens}
        if figures.position is not None:
            out["comparison_reusable_tokens"] = figures.position
    elif figures.reason != NO_MISS:
        out = {"type": "unavailable"}
    else:
        out = {"type": "cache_hit"}
    return {**out, "kvserve_cache_report": figures.as_dict()}


async def respond_responses(
    ctx: ServerContext,
    store: ResponseStore,
    request: Request,
    body: ResponsesRequest,
    prepared: ResponsesPlan,
    room: Reservation,
    tenant: str,
) -> Response:
    """Run the plan's one sample and answer as a Responses object or its event stream."""
    run = _Run(ctx, store, request, body, prepared)
    generation = run.generation(room)
    plan = prepared.plan
    try:
        await cancel_on_disconnect(request, generation.start())
        figures = await report(ctx, plan, [generation])
    except BaseException:
        await generation.close(log_line=False)
        raise
    compared = comparison_id(body)
    if compared is not None:
        run.diagnostics = diagnosis(ctx, plan.namespace, compared, figures)
    ctx.misses.answered(plan.namespace, run.id, figures)
    headers = {CACHE_HEADER: figures.header()}
    if body.stream:
        streamed = EventStreamResponse(_events(run, request, generation, tenant), [generation])
        streamed.headers.update(headers)
        return streamed
    await cancel_on_disconnect(request, generation.run())
    reply = _whole_reply(run)
    run.remember(generation)
    run.kept = await retain_plan(ctx, plan)
    response = run.response(reply, generation, run.status())
    data = await run.answer(response, reply, tenant)
    return Response(data, media_type="application/json", headers=headers)
