"""OpenAI tools on any chat model: the request's tools checked, rendered in the model's format, and the
grammar that constrains the reply to it.

The format is the server's (server/core/chat_setup.py, one of server/tool_formats). A template that renders
tools gets them as its `tools` variable, the calls as the assistant's text written exactly as the
constrained model writes them, and the results as `tool` messages. Otherwise tools travel as text in
the generic format (docs/api.md, *Tools*):

- the tools are listed in the system prompt, one JSON object per line (`TOOLS_HEADER` and `CALL_HOWTO`);
- a call is one line, `<tool_call>{"name": "NAME", "arguments": ARGS}</tool_call>`, where ARGS is
  compact JSON matching the tool's `parameters` schema; parallel calls are consecutive lines;
- a tool's result comes back as a user turn, `<tool_response>CONTENT</tool_response>`, one line per
  result of consecutive `tool` messages.

Decoding is constrained (a Lark grammar with the schemas embedded, engine/grammar.py): `required` and a
named function produce exactly calls, `auto` produces calls or plain text that does not start as calls
do, `none` only such text; with reasoning on, a think block may come first. The tools are listed
whatever the choice, so that every turn of a conversation starts with the same prompt and finds it in
the prefix cache. An assistant message with `tool_calls` renders back as the very text that was
generated (the arguments string is the generated one), so the reply memory finds its ids and turn 2
hits turn 1's KV.
"""

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.engine.grammar import StructuredOutputs
from kvserve.errors import InvalidRequestError
from kvserve.model.tokenizer import MessageDict
from kvserve.server.core.messages import ChatMessage
from kvserve.server.core.reasoning import THINK_CLOSE, THINK_OPEN, THINK_SEP
from kvserve.server.core.tool_formats import ToolFormat
from kvserve.server.core.tool_formats.layout import NAME_PATTERN, ParsedCall
from kvserve.server.core.tool_formats.syntax import CallSyntax

CALL_OPEN = "<tool_call>"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"
TOOLS_HEADER = "# Tools\n\nYou may call these functions (JSON Schema signatures, one per line):\n"
CALL_HOWTO = (
    "\nTo call functions, reply with one line per call and nothing else:\n"
    f'{CALL_OPEN}{{"name": "<function name>", "arguments": <arguments as JSON>}}</tool_call>\n'
    f"Results come back as {RESPONSE_OPEN}...{RESPONSE_CLOSE}."
)
_NAME = re.compile(NAME_PATTERN)
MAX_TOOLS = 128


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolUse:
    """The tools a request offers and how it lets the model use them: `choice` is "none", "auto",
    "required" or the name of the one function to call."""

    tools: tuple[Tool, ...]
    choice: str
    parallel: bool = True


def _tool(i: int, raw: Any) -> Tool:
    param = f"tools[{i}]"
    if not isinstance(raw, dict) or raw.get("type", "function") != "function":
        raise InvalidRequestError(f"{param} must be a function tool", param)
    fn = raw.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _NAME.fullmatch(fn["name"]):
        raise InvalidRequestError(
            f"{param}.function.name must be 1-64 letters, digits, underscores or dashes", param
        )
    parameters = fn.get("parameters", {"type": "object"})
    description = fn.get("description", "")
    if not isinstance(parameters, dict) or not isinstance(description, str):
        raise InvalidRequestError(
            f"{param}.function needs an object 'parameters' and a string 'description'", param
        )
    return Tool(fn["name"], description, parameters)


def offered_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool) -> ToolUse | None:
    """Tools and a tool_choice in OpenAI's shapes, checked; None when there are no tools. Every API's
    converter maps its tools to these shapes and shares the checks."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice needs tools", "tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"at most {MAX_TOOLS} tools are accepted", "tools")
    checked = tuple(_tool(i, t) for i, t in enumerate(tools))
    names = [t.name for t in checked]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tool names must be distinct", "tools")
    choice = tool_choice if tool_choice is not None else "auto"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or name not in names:
            raise InvalidRequestError("tool_choice must name one of the tools' functions", "tool_choice")
        return ToolUse(checked, str(name), parallel)
    if choice not in ("none", "auto", "required"):
        raise InvalidRequestError(
            "tool_choice must be none, auto, required or {type: function, function: {name}}", "tool_choice"
        )
    return ToolUse(checked, str(choice), parallel)


def _system_text(use: ToolUse) -> str:
    lines = [
        json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters})
        for t in use.tools
    ]
    return TOOLS_HEADER + "\n".join(lines) + "\n" + CALL_HOWTO


def _assistant(message: ChatMessage, layout: CallSyntax) -> MessageDict:
    """An assistant message with its calls written in its text as the model writes them."""
    calls = [
        ParsedCall(c.function.name, c.function.arguments) for c in message.tool_calls or () if c.function
    ]
    turn: MessageDict = {"role": "assistant", "content": layout.reply_text(message.text, calls)}
    reasoning = message.reasoning_content if message.reasoning_content is not None else message.reasoning
    if reasoning is not None:
        turn["reasoning_content"] = reasoning
    return turn


def template_tools(use: ToolUse) -> list[dict[str, Any]]:
    """The tools as a template's `tools` variable takes them (OpenAI's shape)."""
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
        }
        for t in use.tools
    ]


def _generic_conversation(
    messages: Sequence[ChatMessage], use: ToolUse | None, fmt: ToolFormat[Any]
) -> list[MessageDict]:
    """Tools in the system prompt, calls and results as text in the generic format (a template need
    not know roles other than system, user, assistant)."""
    out: list[MessageDict] = []
    merged_results = -1
    for m in messages:
        if m.role == "tool":
            result = RESPONSE_OPEN + m.text + RESPONSE_CLOSE
            if out and merged_results == len(out) - 1:
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result})
                merged_results = len(out) - 1
        elif m.role == "assistant":
            out.append(_assistant(m, fmt.layout))
        else:
            out.append({"role": m.role, "content": m.text})
    if use is not None:
        if out and out[0]["role"] == "system":
            out[0]["content"] += "\n\n" + _system_text(use)
        else:
            out.insert(0, {"role": "system", "content": _system_text(use)})
    return out


def _template_conversation(
    messages: Sequence[ChatMessage], use: ToolUse | None, fmt: ToolFormat[Any]
) -> list[MessageDict]:
    """The messages for a template that renders tools itself: `tool` messages as they are (with the
    called function's name, which some templates print), calls as the assistant's text."""
    names = {c.id: c.function.name for m in messages for c in m.tool_calls or ()}
    out: list[MessageDict] = []
    for m in messages:
        if m.role == "tool":
            turn: MessageDict = {"role": "tool", "content": m.text, "tool_call_id": m.tool_call_id or ""}
            if m.tool_call_id in names:
                turn["name"] = names[m.tool_call_id]
            out.append(turn)
        elif m.role == "assistant":
            out.append(_assistant(m, fmt.layout))
        else:
            out.append({"role": m.role, "content": m.text})
    if use is not None and fmt.tools_in_system:
        tools_json = json.dumps(template_tools(use))
        if out and out[0]["role"] == "system":
            out[0]["tools"] = tools_json
        else:
            out.insert(0, {"role": "system", "content": "", "tools": tools_json})
    return out


def conversation(
    messages: Sequence[ChatMessage], use: ToolUse | None, fmt: ToolFormat[Any]
) -> list[MessageDict]:
    """The messages as the chat template sees them under the tool format `fmt`."""
    if fmt.in_template:
        return _template_conversation(messages, use, fmt)
    return _generic_conversation(messages, use, fmt)


# Where a reply may reason before it answers: not at all, optionally (the reply may open a think
# block), or it must end the block the prompt opened.
NO_THINK = "none"
MAY_THINK = "may"
IN_THINK = "in"


def _think_rules(think: str) -> tuple[str, list[str]]:
    """The start rule's prefix for reasoning and its rules: the block ends at its first close tag."""
    end = f"{json.dumps(THINK_CLOSE)} {json.dumps(THINK_SEP)}"
    if think == MAY_THINK:
        return "think? ", [f"think[lazy]: {json.dumps(THINK_OPEN)} /(?s:.*)/ {end}"]
    if think == IN_THINK:
        return "think ", [f"think[lazy]: /(?s:.*)/ {end}"]
    return "", []


def constraint(use: ToolUse, layout: CallSyntax, think: str = NO_THINK) -> StructuredOutputs:
    """The grammar of what the model may answer under `use`, in `layout`'s calls."""
    prefix, lines = _think_rules(think)
    if use.choice == "none":
        return StructuredOutputs(
            grammar="\n".join([f"start: {prefix}TEXT", layout.text_rule(), *lines]) + "\n"
        )
    tools = [(t.name, t.parameters) for t in use.tools if use.choice in ("auto", "required", t.name)]
    parallel = use.parallel and use.choice in ("auto", "required")
    body, rules = layout.calls_grammar(tools, parallel, use.choice == "auto")
    return StructuredOutputs(grammar="\n".join([f"start: {prefix}{body}", *rules, *lines]) + "\n")
