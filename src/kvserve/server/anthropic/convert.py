"""An Anthropic message request as the chat it is: the neutral messages and tools, the template
variables its `thinking` sets, where its cache breakpoints fall, and its plan (`messages_plan`): the one
place its defaults and its max_tokens rule live.

Defaults: temperature and top_p 1, no top_k, unless given; `stop_sequences` are the stop strings;
`output_config.format` (a JSON schema) is the output constraint.

max_tokens: required, between 0 and MAX_MAX_TOKENS (else a 400); clamped to the room the prompt leaves
in the context (`OverContext.CLAMP`), as a client that asks for its model's whole output budget expects
to be served, the reply ending `max_tokens` there; a prompt that fills the context is refused for its
length, unless it is a pre-warm's. 0 is a pre-warm, as Anthropic's: the prompt is computed and kept
(its breakpoints retained as for any request), and the answer has no content, stop_reason `max_tokens`
and the usage of the write.

The chat path (server/core/prompts.py, server/core/tools.py) then renders it exactly as it renders a chat
completion, so both APIs share the template, the tool format, the constraint and the reply memory:

- `system` (a string or text blocks) is the first system turn; a `system` turn inside `messages` stays
  where it is.
- A user turn's text blocks are its content (joined with newlines, as chat joins text parts); each
  `tool_result` is a `tool` message, in the order of the blocks. Its `tool_use_id` must name a
  `tool_use` of the assistant turn right before it.
- An assistant turn's text blocks are its content, its `thinking` blocks its reasoning, and each
  `tool_use` a tool call whose arguments are its `input` as compact JSON: the text the constrained
  model wrote, so that the reply memory finds the reply and the next turn reads its KV through the call.
- Image, document and every other block type are refused by name: ignoring them would answer another
  question.

A breakpoint (`cache_control` on a block, a tool or the request) is recorded as the conversation up to
and including its block; `messages_plan` renders each and takes its common prefix with the whole prompt as the
breakpoint's offset in tokens. A tool's breakpoint falls at the end of the system turn, where the
tools are rendered; the request's own falls at the end of the last message.
"""

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.grammar import StructuredOutputs
from kvserve.engine.sampling_params import SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.server.anthropic.protocol import (
    MAX_MAX_TOKENS,
    Block,
    CacheControl,
    Content,
    MessagesBase,
    MessagesRequest,
)
from kvserve.server.core.context import ServerContext
from kvserve.server.core.messages import ChatMessage, ContentPart, FunctionCall, ToolCall
from kvserve.server.core.plan import CacheBreakpoint, RequestPlan, rendered_chat_plan
from kvserve.server.core.prompt_cache import breakpoint_at
from kvserve.server.core.prompts import chat_prompt
from kvserve.server.core.request import ChatRequest, OverContext
from kvserve.server.core.tools import ToolUse, offered_tools

# Anthropic's limit: at most this many breakpoints in one request, the top-level one included.
MAX_BREAKPOINTS = 4
TTL_S = {None: 300.0, "5m": 300.0, "1h": 3600.0}
THINKING_TYPES = ("enabled", "disabled", "adaptive")
_READ = "kvserve reads text, tool_use, tool_result and thinking blocks"


@dataclass(frozen=True)
class Breakpoint:
    """The conversation up to and including a breakpoint's block, and how long its prefix is kept."""

    messages: tuple[ChatMessage, ...]
    ttl_s: float


@dataclass(frozen=True)
class AnthropicChat:
    """A message request as a chat: its turns, its tools, its template variables, its breakpoints."""

    messages: list[ChatMessage]
    tools: ToolUse | None
    kwargs: dict[str, Any] = field(default_factory=dict)
    breakpoints: tuple[Breakpoint, ...] = ()
    # `output_config.effort`, which a harmony chat's template takes.
    effort: str | None = None


def _ttl(control: CacheControl, param: str) -> float:
    if control.type != "ephemeral":
        raise InvalidRequestError(f"{param}.type must be 'ephemeral', not {control.type!r}", f"{param}.type")
    if control.ttl not in TTL_S:
        raise InvalidRequestError(f"{param}.ttl must be '5m' or '1h', not {control.ttl!r}", f"{param}.ttl")
    return TTL_S[control.ttl]


def _text_message(role: str, texts: list[str]) -> ChatMessage:
    return ChatMessage.model_validate(
        {"role": role, "content": [ContentPart(type="text", text=t) for t in texts]}
    )


def _arguments(block: Block, param: str) -> str:
    """A tool_use's input as the compact JSON text a constrained call writes."""
    try:
        return json.dumps(block.input or {}, separators=(",", ":"), ensure_ascii=False)
    except (ValueError, RecursionError):
        raise InvalidRequestError(f"{param}.input is nested too deeply", f"{param}.input") from None


def _result_text(block: Block, param: str) -> str:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    texts = []
    for k, inner in enumerate(block.content):
        if inner.type != "text" or inner.text is None:
            where = f"{param}.content[{k}]"
            raise InvalidRequestError(
                f"{where} is a {inner.type!r} block; a tool result's content is read as text only", where
            )
        texts.append(inner.text)
    return "\n".join(texts)


class _Converter:
    """Builds the chat turn by turn; a breakpoint takes the turns so far and the one being built."""

    def __init__(self, max_breakpoints: int) -> None:
        self.out: list[ChatMessage] = []
        self.breakpoints: list[Breakpoint] = []
        self.max_breakpoints = max_breakpoints
        # The tool_use ids of the last assistant turn: the ones the next user turn may answer.
        self.open_calls: set[str] = set()

    def mark(self, partial: list[ChatMessage], control: CacheControl | None, param: str) -> None:
        if control is not None:
            self.add(tuple(self.out + partial), _ttl(control, f"{param}.cache_control"))

    def add(self, messages: tuple[ChatMessage, ...], ttl_s: float) -> None:
        # Refused at the first one too many: each copies the conversation so far.
        if len(self.breakpoints) == self.max_breakpoints:
            raise InvalidRequestError(
                f"at most {MAX_BREAKPOINTS} blocks may carry cache_control (the top-level one included)",
                "cache_control",
            )
        self.breakpoints.append(Breakpoint(messages, ttl_s))

    def system(self, content: Content, param: str) -> None:
        if isinstance(content, str):
            self.out.append(_text_message("system", [content]))
            return
        texts: list[str] = []
        for j, block in enumerate(content):
            where = f"{param}[{j}]" if param == "system" else f"{param}.content[{j}]"
            if block.type != "text" or block.text is None:
                raise InvalidRequestError(
                    f"{where} is a {block.type!r} block; a system prompt is text", where
                )
            texts.append(block.text)
            self.mark([_text_message("system", texts)], block.cache_control, where)
        self.out.append(_text_message("system", texts))

    def user(self, content: Content, param: str) -> None:
        if isinstance(content, str):
            self.out.append(_text_message("user", [content]))
            self.open_calls = set()
            return
        texts: list[str] = []
        partial: list[ChatMessage] = []
        for j, block in enumerate(content):
            where = f"{param}.content[{j}]"
            if block.type == "text" and block.text is not None:
                texts.append(block.text)
            elif block.type == "tool_result":
                if block.tool_use_id not in self.open_calls:
                    raise InvalidRequestError(
                        f"{where}.tool_use_id {block.tool_use_id!r} answers no tool_use block of the "
                        "assistant turn before it",
                        f"{where}.tool_use_id",
                    )
                if texts:
                    partial.append(_text_message("user", texts))
                    texts = []
                result = ChatMessage(
                    role="tool", content=_result_text(block, where), tool_call_id=block.tool_use_id
                )
                partial.append(result)
            elif block.type in ("tool_use", "thinking"):
                raise InvalidRequestError(f"{where} is a {block.type} block in a user turn", where)
            else:
                raise _unread(block, where)
            self.mark(partial + ([_text_message("user", texts)] if texts else []), block.cache_control, where)
        self.out += partial + ([_text_message("user", texts)] if texts else [])
        self.open_calls = set()

    def assistant(self, content: Content, param: str) -> None:
        if isinstance(content, str):
            self.out.append(ChatMessage(role="assistant", content=content))
            self.open_calls = set()
            return
        texts: list[str] = []
        thinking: list[str] = []
        calls: list[ToolCall] = []

        def turn() -> ChatMessage:
            return ChatMessage(
                role="assistant",
                content="\n".join(texts),
                tool_calls=calls or None,
                reasoning_content="\n".join(thinking) if thinking else None,
            )

        for j, block in enumerate(content):
            where = f"{param}.content[{j}]"
            if block.type == "text" and block.text is not None:
                texts.append(block.text)
            elif block.type == "thinking" and block.thinking is not None:
                thinking.append(block.thinking)
            elif block.type == "tool_use":
                if not block.id or not block.name:
                    raise InvalidRequestError(f"{where} needs an 'id' and a 'name'", where)
                function = FunctionCall(name=block.name, arguments=_arguments(block, where))
                calls.append(ToolCall(id=block.id, function=function))
            elif block.type == "tool_result":
                raise InvalidRequestError(f"{where} is a tool_result block in an assistant turn", where)
            else:
                raise _unread(block, where)
            self.mark([turn()], block.cache_control, where)
        self.out.append(turn())
        self.open_calls = {c.id for c in calls}


def _unread(block: Block, where: str) -> InvalidRequestError:
    if block.type in ("text", "thinking"):
        return InvalidRequestError(f"{where} is a {block.type} block without its {block.type!r} field", where)
    return InvalidRequestError(f"{where} is a {block.type!r} block; {_READ}", where)


def _tools(body: MessagesBase) -> tuple[list[Any] | None, list[CacheControl]]:
    """The tools in OpenAI's shape, and the breakpoints set on them."""
    if body.tools is None:
        return None, []
    tools: list[Any] = []
    controls: list[CacheControl] = []
    for i, raw in enumerate(body.tools):
        param = f"tools[{i}]"
        if not isinstance(raw, dict):
            raise InvalidRequestError(f"{param} must be an object", param)
        kind = raw.get("type")
        if kind not in (None, "custom"):
            raise InvalidRequestError(
                f"{param} is a tool of type {str(kind)!r} that only Anthropic runs; kvserve serves custom "
                "tools (name, description, input_schema)",
                param,
            )
        function = {
            "name": raw.get("name"),
            "description": raw.get("description", ""),
            "parameters": raw.get("input_schema", {"type": "object"}),
        }
        tools.append({"type": "function", "function": function})
        if raw.get("cache_control") is not None:
            try:
                controls.append(CacheControl.model_validate(raw["cache_control"]))
            except ValueError:
                raise InvalidRequestError(
                    f"{param}.cache_control must be an object with a 'type'", param
                ) from None
    return tools, controls


def _tool_choice(body: MessagesBase) -> tuple[Any, bool]:
    """tool_choice in OpenAI's shape, and whether calls may be parallel."""
    choice = body.tool_choice
    if choice is None:
        return None, True
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))
    if mapped is None:
        raise InvalidRequestError("tool_choice type must be auto, any, tool or none", "tool_choice")
    return mapped, parallel


def thinking_kwargs(body: MessagesBase, reasoning: bool) -> dict[str, Any]:
    """The template variable a reasoning model's template reads (Qwen3's `enable_thinking`): on for
    thinking enabled or adaptive, off otherwise, as Anthropic's models answer without thinking unless
    asked. Without a reasoning parser nothing is set: thinking is accepted without effect."""
    thinking = body.thinking
    kind = None if thinking is None else thinking.get("type")
    if thinking is not None and kind not in THINKING_TYPES:
        raise InvalidRequestError(
            f"thinking type must be one of {', '.join(THINKING_TYPES)}", "thinking.type"
        )
    return {"enable_thinking": kind in ("enabled", "adaptive")} if reasoning else {}


def anthropic_chat(body: MessagesBase, reasoning: bool) -> AnthropicChat:
    """The request as a chat, every block checked; InvalidRequestError names the first bad one."""
    tools, tool_controls = _tools(body)
    choice, parallel = _tool_choice(body)
    use = offered_tools(tools, choice, parallel)
    top = None if body.cache_control is None else _ttl(body.cache_control, "cache_control")
    convert = _Converter(MAX_BREAKPOINTS - (top is not None))
    if body.system is not None:
        convert.system(body.system, "system")
    system_turns = list(convert.out)
    for i, control in enumerate(tool_controls):
        convert.add(tuple(system_turns), _ttl(control, f"tools[{i}].cache_control"))
    for i, message in enumerate(body.messages):
        param = f"messages[{i}]"
        if message.role == "system":
            convert.system(message.content, param)
        elif message.role == "user":
            convert.user(message.content, param)
        else:
            convert.assistant(message.content, param)
    # System turns may follow the last user turn (Claude Code sends its reminders there); the last
    # other turn is the one the reply answers.
    turns = [i for i, m in enumerate(body.messages) if m.role != "system"]
    if not turns or body.messages[turns[-1]].role != "user":
        last = turns[-1] if turns else len(body.messages) - 1
        raise InvalidRequestError(
            "the last message other than system turns must be a user turn; kvserve does not continue an "
            "assistant turn (prefill)",
            f"messages[{last}].role",
        )
    breakpoints = list(convert.breakpoints)
    if top is not None:
        breakpoints.append(Breakpoint(tuple(convert.out), top))
    effort = (getattr(body, "output_config", None) or {}).get("effort")
    return AnthropicChat(
        convert.out,
        use,
        thinking_kwargs(body, reasoning),
        tuple(breakpoints),
        effort if isinstance(effort, str) else None,
    )


def _tokens(
    ctx: ServerContext, chat: AnthropicChat, messages: Sequence[ChatMessage], namespace: str, reply: bool
) -> list[int]:
    return chat_prompt(
        ctx.async_engine,
        ctx.prompt_guard,
        messages,
        namespace,
        reply,
        chat.tools,
        ctx.chat,
        chat.kwargs,
        chat.effort,
    )


def messages_tokens(ctx: ServerContext, body: MessagesBase, namespace: str) -> list[int]:
    """The prompt an Anthropic message request prefills (what count_tokens counts)."""
    chat = anthropic_chat(body, ctx.chat.reasoning)
    return _tokens(ctx, chat, chat.messages, namespace, True)


def _breakpoints(
    ctx: ServerContext, chat: AnthropicChat, token_ids: list[int], namespace: str
) -> tuple[CacheBreakpoint, ...]:
    """Each breakpoint's offset in the prompt, found as every API finds it
    (server/core/prompt_cache.py:breakpoint_at)."""

    def render(messages: Sequence[ChatMessage]) -> list[int]:
        return _tokens(ctx, chat, messages, namespace, False)

    found = (breakpoint_at(b.messages, b.ttl_s, token_ids, render) for b in chat.breakpoints)
    return tuple(sorted((b for b in found if b is not None), key=lambda b: b.tokens))


def _output_format(body: MessagesRequest) -> StructuredOutputs | None:
    spec = (body.output_config or {}).get("format")
    if spec is None:
        return None
    if (
        not isinstance(spec, dict)
        or spec.get("type") != "json_schema"
        or not isinstance(spec.get("schema"), dict)
    ):
        raise InvalidRequestError(
            "output_config.format must be {type: json_schema, schema: {...}}", "output_config.format"
        )
    return StructuredOutputs(json=spec["schema"])


def messages_plan(ctx: ServerContext, body: MessagesRequest, namespace: str) -> RequestPlan:
    """An Anthropic message's plan: the request rendered as a chat and planned as one, under the
    module's defaults and max_tokens rule, and where its cache breakpoints fall."""
    if not 0 <= body.max_tokens <= MAX_MAX_TOKENS:
        raise InvalidRequestError(f"max_tokens must be between 0 and {MAX_MAX_TOKENS}", "max_tokens")
    chat = anthropic_chat(body, ctx.chat.reasoning)
    token_ids = _tokens(ctx, chat, chat.messages, namespace, True)
    params = SamplingParams(
        max_tokens=body.max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        stop=list(body.stop_sequences or []),
        structured_outputs=_output_format(body),
    )
    request = ChatRequest(
        tuple(chat.messages),
        params,
        chat.tools,
        chat.kwargs,
        OverContext.CLAMP,
        system_apart=body.system is not None,
    )
    plan = rendered_chat_plan(ctx, request, token_ids, namespace)
    return dataclasses.replace(plan, breakpoints=_breakpoints(ctx, chat, token_ids, namespace))
