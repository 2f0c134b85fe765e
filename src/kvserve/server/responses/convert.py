"""A Responses request as the neutral chat request (`responses_request`, `responses_plan`): the one place
its defaults and its max_output_tokens rule live.

Defaults: temperature and top_p 1 unless given; every other sampling value the engine's default (no
top_k, no penalties, one sample); the text format is the output constraint (`response_format`).

max_output_tokens: below 0 is a 400 (`check_fields`); unset is "up to the context"; a prompt plus
max_output_tokens over the context is not refused: the reply may fill the room the prompt leaves
(`OverContext.FILL`), and a reply cut there is `incomplete` with reason max_output_tokens. 0 is a
pre-warm, the equivalent of Anthropic's `max_tokens: 0`: the prompt is computed and kept in the cache
like any request's, and the response is `incomplete` (reason max_output_tokens) with no output items;
usage shows the prompt and what of it the cache held (`input_tokens_details.cached_tokens`). Stored, it
keeps the conversation without a reply, so that a request continuing it reads the pre-warmed prompt.
`prompt_cache_options.prewarm: true` (OpenAI's own spelling) is the same pre-warm.

Items become chat messages: `developer` is a system message, a run of `function_call` items one assistant
message with those calls (its calls render back as the exact text generated, server/core/tools.py), a
`function_call_output` a tool message, and a `reasoning` item the reasoning of the assistant message that
follows it. Every `function_call_output` must answer a call of the conversation (this request's or a stored
response's). Function tools become chat tools; a `namespace` group is flattened to its functions; tool types
that only OpenAI runs (`web_search`, `file_search`, `code_interpreter`, ...) are dropped with a warning in
the log (docs/api.md, *Responses API*). A response lists the tools offered, with the fields acted on,
and nothing else of them (`response_tools`): what the server ignores is neither echoed nor stored.
An `additional_tools` item (Codex sends its tools so, in `input`) adds its tools to the request's and renders
nothing itself, its id no more than any item's id, so that a resent conversation renders the same prompt.

A `custom` tool (OpenAI's freeform tools: the call's input is free text) is offered to the model as a
function taking one string, {"input": "..."}: its call is constrained as any function call is, to that
object, and its free text is the string; a `grammar` format is not enforced (the model may write any
string). A `custom_tool_call` item is that call (the input as the JSON object's one string) and a
`custom_tool_call_output` its tool message, as function calls are. Nothing here raises but
InvalidRequestError, whose param names the item or tool.
"""

import dataclasses
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.engine.sampling_params import SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.server.core.context import ServerContext
from kvserve.server.core.messages import ChatMessage, FunctionCall, ToolCall
from kvserve.server.core.plan import RequestPlan, rendered_chat_plan
from kvserve.server.core.prompt_cache import CachePolicy, Marker, cache_breakpoints, cache_policy, marker_ttl
from kvserve.server.core.prompts import Continuation, chat_prompt, continued_chat_prompt
from kvserve.server.core.request import ChatRequest, OverContext
from kvserve.server.core.structured import structured_outputs
from kvserve.server.core.tools import ToolUse, offered_tools
from kvserve.server.responses.protocol import (
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_KEYS,
    MAX_METADATA_VALUE_CHARS,
    MAX_TOOL_ENTRIES,
    InputItem,
    InputPart,
    ResponsesRequest,
    TextFormat,
)

log = logging.getLogger("kvserve.server")

MESSAGE_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")
# A namespace may hold functions only (no namespace in a namespace).
NAMESPACE = "namespace"
CUSTOM = "custom"
ADDITIONAL_TOOLS = "additional_tools"
# A custom tool's one argument, as the model writes it.
CUSTOM_INPUT = "input"
CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {CUSTOM_INPUT: {"type": "string"}},
    "required": [CUSTOM_INPUT],
    "additionalProperties": False,
}
_CALLS = ("function_call", "custom_tool_call")
_CALL_OUTPUTS = ("function_call_output", "custom_tool_call_output")


def _parts_text(parts: str | Sequence[InputPart] | None, param: str) -> str:
    if parts is None or isinstance(parts, str):
        return parts or ""
    for j, part in enumerate(parts):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise InvalidRequestError(
                f"{param}[{j}] is a content part of type {part.type[:64]!r}; kvserve reads text parts only "
                "(input_text, output_text)",
                f"{param}[{j}]",
            )
    # Joined as chat joins a message's text parts (server/openai/protocol.py), so both give the same prompt.
    return "\n".join(part.text or "" for part in parts)


def _required(value: str | None, param: str, kind: str) -> str:
    if not isinstance(value, str):
        raise InvalidRequestError(f"{param} is missing: a {kind} item needs it", param)
    return value


def input_markers(
    items: str | Sequence[InputItem],
    instructions: Sequence[ChatMessage],
    history: Sequence[ChatMessage],
    policy: CachePolicy,
) -> list[Marker]:
    """The breakpoints the content parts of input items carry, first to last. Each keeps the
    conversation through its whole item (an item's parts are joined into one message's text)."""
    if isinstance(items, str):
        return []
    found: list[Marker] = []
    for i, item in enumerate(items):
        if isinstance(item.content, str) or item.content is None:
            continue
        where = f"input[{i}].content"
        ttls = [
            marker_ttl(part.prompt_cache_breakpoint, f"{where}[{j}].prompt_cache_breakpoint", policy)
            for j, part in enumerate(item.content)
        ]
        marked = [t for t in ttls if t is not None]
        if marked:
            try:
                cut = input_messages(items[: i + 1], history)
            except InvalidRequestError:
                # The input cut at this item is not a conversation of its own: the marker keeps nothing.
                continue
            found.append(Marker((*instructions, *history, *cut), max(marked)))
    return found


def known_call_ids(messages: Iterable[ChatMessage]) -> set[str]:
    return {c.id for m in messages for c in m.tool_calls or ()}


def input_messages(items: str | Sequence[InputItem], history: Sequence[ChatMessage]) -> list[ChatMessage]:
    """The request's input as chat messages, to follow `history` (a stored conversation, or none)."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    calls = known_call_ids(history)
    out: list[ChatMessage] = []
    reasoning: str | None = None
    # The assistant message that the function_call items of the current run join.
    calling: ChatMessage | None = None
    for i, item in enumerate(items):
        param = f"input[{i}]"
        kind = item.type if item.type is not None else ("message" if item.role is not None else None)
        if kind not in _CALLS:
            calling = None
        if kind == "message":
            if item.role not in MESSAGE_ROLES:
                raise InvalidRequestError(
                    f"{param}.role must be one of {', '.join(MESSAGE_ROLES)}, not {str(item.role)[:32]!r}",
                    f"{param}.role",
                )
            role = "system" if item.role == "developer" else item.role
            text = _parts_text(item.content, f"{param}.content")
            if role == "assistant":
                out.append(ChatMessage(role="assistant", content=text, reasoning_content=reasoning))
                reasoning = None
            else:
                out.append(ChatMessage(role=role, content=text))  # type: ignore[arg-type]
        elif kind == ADDITIONAL_TOOLS:
            # Its tools joined the request's (additional_tools below); nothing of it is rendered here.
            continue
        elif kind in _CALLS:
            call_id = _required(item.call_id, f"{param}.call_id", kind)
            name = _required(item.name, f"{param}.name", kind)
            if kind == "function_call":
                arguments = _required(item.arguments, f"{param}.arguments", kind)
            else:
                arguments = custom_arguments(_required(item.input, f"{param}.input", kind))
            call = ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments))
            calls.add(call_id)
            if calling is None:
                calling = ChatMessage(role="assistant", tool_calls=[], reasoning_content=reasoning)
                reasoning = None
                out.append(calling)
            assert calling.tool_calls is not None
            calling.tool_calls.append(call)
        elif kind in _CALL_OUTPUTS:
            call_id = _required(item.call_id, f"{param}.call_id", kind)
            if call_id not in calls:
                raise InvalidRequestError(
                    f"{param}.call_id matches no function_call or custom_tool_call of this conversation",
                    f"{param}.call_id",
                )
            text = _parts_text(item.output, f"{param}.output")
            out.append(ChatMessage(role="tool", tool_call_id=call_id, content=text))
        elif kind == "reasoning":
            parts = item.content if isinstance(item.content, list) and item.content else item.summary
            text = _parts_text(parts, f"{param}.content")
            reasoning = text if reasoning is None else reasoning + "\n" + text
        else:
            raise InvalidRequestError(
                f"{param} is an item of type {str(kind)[:64]!r}; kvserve reads message, function_call, "
                "function_call_output, custom_tool_call, custom_tool_call_output, reasoning and "
                "additional_tools items",
                param,
            )
    return out


def _function(raw: dict[str, Any], param: str) -> dict[str, Any]:
    """A Responses function tool (flat: name, description, parameters) in chat's shape."""
    fn = {k: raw[k] for k in ("name", "description", "parameters") if k in raw and raw[k] is not None}
    if "name" not in fn:
        raise InvalidRequestError(f"{param} is a function tool without a name", param)
    return {"type": "function", "function": fn}


def custom_arguments(text: str) -> str:
    """A custom tool call's free-text input as the arguments of the function it is offered as."""
    return json.dumps({CUSTOM_INPUT: text}, ensure_ascii=False)


def custom_input(arguments: str) -> str:
    """The free text of a custom tool call, from the arguments the model generated (constrained to
    {"input": string}; the arguments themselves where they are not that, as a reply cut short)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    text = parsed.get(CUSTOM_INPUT) if isinstance(parsed, dict) else None
    return text if isinstance(text, str) else arguments


def _custom(raw: dict[str, Any], param: str) -> dict[str, Any]:
    """A custom (freeform) tool as a function taking its free text as one string."""
    name = raw.get("name")
    if not isinstance(name, str):
        raise InvalidRequestError(f"{param} is a custom tool without a name", param)
    fn: dict[str, Any] = {"name": name, "parameters": CUSTOM_PARAMETERS}
    if isinstance(raw.get("description"), str):
        fn["description"] = raw["description"]
    return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ListedTools:
    """The request's tools as chat tools, the names of those that are custom tools, and the hosted
    tool types dropped."""

    tools: list[dict[str, Any]] | None
    custom: frozenset[str]
    dropped: list[str]


def additional_tools(items: str | Sequence[InputItem]) -> list[tuple[str, Any]]:
    """The tools of the input's `additional_tools` items, each with the param that names it."""
    if isinstance(items, str):
        return []
    out: list[tuple[str, Any]] = []
    for i, item in enumerate(items):
        if item.type != ADDITIONAL_TOOLS:
            continue
        if item.tools is None:
            param = f"input[{i}]"
            raise InvalidRequestError(f"{param} is an additional_tools item without 'tools'", param)
        out += [(f"input[{i}].tools[{j}]", tool) for j, tool in enumerate(item.tools)]
    if len(out) > MAX_TOOL_ENTRIES:
        raise InvalidRequestError(f"input lists over {MAX_TOOL_ENTRIES} additional tools", "input")
    return out


def chat_tools(tools: Sequence[Any] | None, items: str | Sequence[InputItem] = ()) -> ListedTools:
    """The request's tools and its additional_tools items' tools as chat tools."""
    entries = [(f"tools[{i}]", raw) for i, raw in enumerate(tools or ())] + additional_tools(items)
    out: list[dict[str, Any]] = []
    custom: set[str] = set()
    dropped: list[str] = []
    for param, raw in entries:
        kind = raw.get("type") if isinstance(raw, dict) else None
        if not isinstance(kind, str):
            raise InvalidRequestError(f"{param} must be an object with a 'type'", param)
        if kind == "function":
            out.append(_function(raw, param))
        elif kind == CUSTOM:
            out.append(_custom(raw, param))
            custom.add(raw["name"])
        elif kind == NAMESPACE:
            members = raw.get("tools")
            if not isinstance(members, list):
                raise InvalidRequestError(f"{param} is a namespace without a 'tools' list", param)
            for j, member in enumerate(members):
                inner = f"{param}.tools[{j}]"
                inner_kind = member.get("type", "function") if isinstance(member, dict) else None
                if inner_kind == "function":
                    out.append(_function(member, inner))
                elif inner_kind == CUSTOM:
                    out.append(_custom(member, inner))
                    custom.add(member["name"])
                elif isinstance(inner_kind, str) and inner_kind != NAMESPACE:
                    dropped.append(inner_kind[:64])
                else:
                    raise InvalidRequestError(f"{inner} must be a function or custom tool", inner)
        else:
            dropped.append(kind[:64])
    if dropped:
        log.warning(
            "responses: dropped tools that only OpenAI runs (kvserve cannot): %s",
            ", ".join(sorted(set(dropped))),
        )
    return ListedTools(out or None, frozenset(custom), dropped)


def _shown(raw: dict[str, Any], kind: str, fields: Mapping[str, type]) -> dict[str, Any]:
    return {"type": kind, **{k: raw[k] for k, t in fields.items() if isinstance(raw.get(k), t)}}


# The fields of a tool the server acts on, with their types: what a response lists of it.
_FUNCTION_FIELDS = {"name": str, "description": str, "parameters": dict, "strict": bool}
# A custom tool's `format` is not enforced (its input is any text, the format's default), so not listed.
_CUSTOM_FIELDS = {"name": str, "description": str}
_NAMESPACE_FIELDS = {"name": str, "description": str}


def _shown_tool(raw: Any) -> dict[str, Any] | None:
    kind = raw.get("type", "function") if isinstance(raw, dict) else None
    if kind == "function":
        return _shown(raw, kind, _FUNCTION_FIELDS)
    if kind == CUSTOM:
        return _shown(raw, kind, _CUSTOM_FIELDS)
    return None


def response_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]]:
    """The tools a response lists (and a stored one keeps): those offered to the model, each with the
    fields the server acts on; a namespace with its function and custom tools. Hosted tools and any
    other field (read by nothing here) are left out. `tools` has passed chat_tools."""
    out: list[dict[str, Any]] = []
    for raw in tools or ():
        if isinstance(raw, dict) and raw.get("type") == NAMESPACE:
            members = [t for t in map(_shown_tool, raw.get("tools") or ()) if t is not None]
            if members:
                out.append({**_shown(raw, NAMESPACE, _NAMESPACE_FIELDS), "tools": members})
        elif (shown := _shown_tool(raw)) is not None:
            out.append(shown)
    return out


def response_tool_choice(choice: Any) -> Any:
    """tool_choice as a response lists it: a mode, or {type, name} (chat_tool_choice has read it)."""
    if choice is None:
        return "auto"
    if isinstance(choice, dict):
        return {"type": choice.get("type"), "name": choice.get("name")}
    return choice


def chat_tool_choice(choice: Any, tools: Sequence[dict[str, Any]] | None) -> Any:
    """tool_choice in chat's shape: none, auto, required, or {type: function, function: {name}} (a
    custom tool is chosen as the function it is offered as)."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", CUSTOM):
        return {"type": "function", "function": {"name": choice.get("name")}}
    kind = choice.get("type") if isinstance(choice, dict) else None
    raise InvalidRequestError(
        f"tool_choice {str(kind)[:64]!r} is not served: give none, auto, required or "
        "{type: function or custom, name} (kvserve runs no hosted tools)",
        "tool_choice",
    )


def response_format(text: TextFormat | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (server/core/structured.py reads it)."""
    if text is None or text.type == "text":
        return None
    if text.type == "json_object":
        return {"type": "json_object"}
    if text.type == "json_schema":
        if not isinstance(text.json_schema, dict):
            raise InvalidRequestError("text.format json_schema needs a 'schema' object", "text.format")
        return {
            "type": "json_schema",
            "json_schema": {"name": text.name or "output", "schema": text.json_schema},
        }
    raise InvalidRequestError(
        f"text.format type {text.type[:64]!r} is not one of text, json_object, json_schema", "text.format"
    )


def check_fields(body: ResponsesRequest) -> None:
    """What the body alone decides: the bounds of metadata and max_output_tokens."""
    if body.max_output_tokens is not None and body.max_output_tokens < 0:
        raise InvalidRequestError("max_output_tokens must be at least 0", "max_output_tokens")
    metadata = body.metadata or {}
    if len(metadata) > MAX_METADATA_KEYS or any(
        len(k) > MAX_METADATA_KEY_CHARS or len(v) > MAX_METADATA_VALUE_CHARS for k, v in metadata.items()
    ):
        raise InvalidRequestError(
            f"metadata holds at most {MAX_METADATA_KEYS} keys of {MAX_METADATA_KEY_CHARS} characters, "
            f"with values of {MAX_METADATA_VALUE_CHARS}",
            "metadata",
        )


@dataclass(frozen=True)
class PreviousResponse:
    """What a stored response hands the next turn: its conversation (without its instructions, which
    are not carried over) and its exact token ids, when its reply can be continued token for token."""

    messages: tuple[ChatMessage, ...]
    continuation: Continuation | None


@dataclass(frozen=True)
class ResponsesPlan:
    """A Responses request's plan, with what storing its response needs: the conversation it renders
    (without instructions) and the text its prompt stands for."""

    plan: RequestPlan
    messages: tuple[ChatMessage, ...]
    prompt_text: str
    tools: ToolUse | None
    # The names of the tools that are custom tools: their calls are answered as custom_tool_call items.
    custom_tools: frozenset[str] = frozenset()
    # The request's tools as its response lists them: those offered, without what nothing here reads.
    response_tools: tuple[dict[str, Any], ...] = ()


def responses_plan(
    ctx: ServerContext, body: ResponsesRequest, namespace: str, previous: PreviousResponse | None
) -> ResponsesPlan:
    """A Responses request's plan: its items after the previous response's conversation (continuing
    that response's exact token ids: only the new items are rendered into new tokens), its instructions
    first, its tools and text format as chat's, and max_output_tokens under its rule (the module's
    docstring). An error on the prompt names `input`."""
    check_fields(body)
    policy = cache_policy(body.prompt_cache_retention, body.prompt_cache_key, body.prompt_cache_options)
    listed = chat_tools(body.tools, body.input)
    history = previous.messages if previous is not None else ()
    conversation = (*history, *input_messages(body.input, history))
    if not conversation:
        raise InvalidRequestError("input is empty: give a message", "input")
    instructions = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    messages = (*instructions, *conversation)
    text_format = response_format(body.text.format if body.text is not None else None)
    tools = offered_tools(
        listed.tools, chat_tool_choice(body.tool_choice, listed.tools), body.parallel_tool_calls
    )
    if ctx.chat.harmony:
        effort = body.reasoning.effort if body.reasoning else None
        token_ids = chat_prompt(
            ctx.async_engine, ctx.prompt_guard, messages, namespace, True, tools, ctx.chat, {}, effort
        )
        prompt_text = ctx.async_engine.tokenizer.decode(token_ids, skip_special_tokens=False)
    else:
        token_ids, prompt_text = continued_chat_prompt(
            ctx.async_engine,
            ctx.prompt_guard,
            messages,
            namespace,
            tools,
            ctx.chat,
            previous.continuation if previous is not None else None,
        )
    params = SamplingParams(
        max_tokens=0 if policy.prewarm else body.max_output_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        structured_outputs=structured_outputs(text_format),
    )
    request = ChatRequest(
        messages,
        params,
        tools,
        over_context=OverContext.FILL,
        prompt_param="input",
        system_apart=bool(instructions),
    )
    plan = rendered_chat_plan(ctx, request, token_ids, namespace)

    def render(cut: Sequence[ChatMessage]) -> list[int]:
        effort = body.reasoning.effort if body.reasoning else None
        return chat_prompt(
            ctx.async_engine, ctx.prompt_guard, cut, namespace, False, tools, ctx.chat, {}, effort
        )

    markers = input_markers(body.input, instructions, history, policy)
    plan = dataclasses.replace(plan, breakpoints=cache_breakpoints(policy, markers, token_ids, render))
    return ResponsesPlan(
        plan, conversation, prompt_text, tools, listed.custom, tuple(response_tools(body.tools))
    )
