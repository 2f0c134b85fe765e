"""A Responses request's input, tools and text format as the chat machinery takes them.

Items become chat messages: `developer` is a system message, a run of `function_call` items one
assistant message with those calls (its calls render back as the exact text generated, server/tools.py),
a `function_call_output` a tool message, and a `reasoning` item the reasoning of the assistant message
that follows it. Every `function_call_output` must answer a call of the conversation (this request's or
a stored response's). Function tools become chat tools; a `namespace` group is flattened to its
functions; tool types that only OpenAI runs (`web_search`, `file_search`, `code_interpreter`, ...) are
dropped with a warning in the log (README, *Responses API*). Nothing here raises but
InvalidRequestError, whose param names the item or tool.
"""

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from kvserve.errors import InvalidRequestError
from kvserve.server.protocol import ChatMessage, FunctionCall, ToolCall
from kvserve.server.responses_protocol import (
    MAX_METADATA_KEY_CHARS,
    MAX_METADATA_KEYS,
    MAX_METADATA_VALUE_CHARS,
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
    # Joined as chat joins a message's text parts (server/protocol.py), so both give the same prompt.
    return "\n".join(part.text or "" for part in parts)


def _required(value: str | None, param: str, kind: str) -> str:
    if not isinstance(value, str):
        raise InvalidRequestError(f"{param} is missing: a {kind} item needs it", param)
    return value


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
        if kind != "function_call":
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
        elif kind == "function_call":
            call_id = _required(item.call_id, f"{param}.call_id", kind)
            name = _required(item.name, f"{param}.name", kind)
            arguments = _required(item.arguments, f"{param}.arguments", kind)
            call = ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments))
            calls.add(call_id)
            if calling is None:
                calling = ChatMessage(role="assistant", tool_calls=[], reasoning_content=reasoning)
                reasoning = None
                out.append(calling)
            assert calling.tool_calls is not None
            calling.tool_calls.append(call)
        elif kind == "function_call_output":
            call_id = _required(item.call_id, f"{param}.call_id", kind)
            if call_id not in calls:
                raise InvalidRequestError(
                    f"{param}.call_id matches no function_call of this conversation", f"{param}.call_id"
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
                "function_call_output and reasoning items",
                param,
            )
    return out


def _function(raw: dict[str, Any], param: str) -> dict[str, Any]:
    """A Responses function tool (flat: name, description, parameters) in chat's shape."""
    fn = {k: raw[k] for k in ("name", "description", "parameters") if k in raw and raw[k] is not None}
    if "name" not in fn:
        raise InvalidRequestError(f"{param} is a function tool without a name", param)
    return {"type": "function", "function": fn}


def chat_tools(tools: Sequence[Any] | None) -> tuple[list[dict[str, Any]] | None, list[str]]:
    """The request's tools as chat tools, and the types dropped (hosted tools kvserve cannot run)."""
    if not tools:
        return None, []
    out: list[dict[str, Any]] = []
    dropped: list[str] = []
    for i, raw in enumerate(tools):
        param = f"tools[{i}]"
        kind = raw.get("type") if isinstance(raw, dict) else None
        if not isinstance(kind, str):
            raise InvalidRequestError(f"{param} must be an object with a 'type'", param)
        if kind == "function":
            out.append(_function(raw, param))
        elif kind == NAMESPACE:
            members = raw.get("tools")
            if not isinstance(members, list):
                raise InvalidRequestError(f"{param} is a namespace without a 'tools' list", param)
            for j, member in enumerate(members):
                inner = f"{param}.tools[{j}]"
                inner_kind = member.get("type", "function") if isinstance(member, dict) else None
                if inner_kind == "function":
                    out.append(_function(member, inner))
                elif isinstance(inner_kind, str) and inner_kind != NAMESPACE:
                    dropped.append(inner_kind[:64])
                else:
                    raise InvalidRequestError(f"{inner} must be a function tool", inner)
        else:
            dropped.append(kind[:64])
    if dropped:
        log.warning(
            "responses: dropped tools that only OpenAI runs (kvserve cannot): %s",
            ", ".join(sorted(set(dropped))),
        )
    return out or None, dropped


def chat_tool_choice(choice: Any, tools: Sequence[dict[str, Any]] | None) -> Any:
    """tool_choice in chat's shape: none, auto, required, or {type: function, function: {name}}."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    kind = choice.get("type") if isinstance(choice, dict) else None
    raise InvalidRequestError(
        f"tool_choice {str(kind)[:64]!r} is not served: give none, auto, required or "
        "{type: function, name} (kvserve runs no hosted tools)",
        "tool_choice",
    )


def response_format(text: TextFormat | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (server/structured.py reads it)."""
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
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise InvalidRequestError("max_output_tokens must be at least 1", "max_output_tokens")
    metadata = body.metadata or {}
    if len(metadata) > MAX_METADATA_KEYS or any(
        len(k) > MAX_METADATA_KEY_CHARS or len(v) > MAX_METADATA_VALUE_CHARS for k, v in metadata.items()
    ):
        raise InvalidRequestError(
            f"metadata holds at most {MAX_METADATA_KEYS} keys of {MAX_METADATA_KEY_CHARS} characters, "
            f"with values of {MAX_METADATA_VALUE_CHARS}",
            "metadata",
        )
