"""OpenAI tools on any chat model: a generic text format, a grammar that enforces it, and its parsing.

The default model's chat template knows no tools, so tools travel as text (the format of README.md,
*Tools*):

- the tools are listed in the system prompt, one JSON object per line (`TOOLS_HEADER` and `CALL_HOWTO`);
- a call is one line, `<tool_call>{"name": "NAME", "arguments": ARGS}</tool_call>`, where ARGS is
  compact JSON matching the tool's `parameters` schema; parallel calls are consecutive lines;
- a tool's result comes back as a user turn, `<tool_response>CONTENT</tool_response>`, one line per
  result of consecutive `tool` messages.

Decoding is constrained (a Lark grammar with the schemas embedded, engine/grammar.py): `required` and a
named function produce exactly calls, `auto` produces calls or plain text that does not start with `<`,
`none` only such text. The tools are listed whatever the choice, so that every turn of a conversation
starts with the same system prompt and finds it in the prefix cache.
An assistant message with `tool_calls` renders back as the very text that was generated (the arguments
string is the generated one), so the reply memory finds its ids and turn 2 hits turn 1's KV.
"""

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.grammar import StructuredOutputs
from kvserve.errors import InvalidRequestError
from kvserve.server.protocol import ChatCompletionRequest, ChatMessage

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"
TOOLS_HEADER = "# Tools\n\nYou may call these functions (JSON Schema signatures, one per line):\n"
CALL_HOWTO = (
    "\nTo call functions, reply with one line per call and nothing else:\n"
    f'{CALL_OPEN}{{"name": "<function name>", "arguments": <arguments as JSON>}}{CALL_CLOSE}\n'
    f"Results come back as {RESPONSE_OPEN}...{RESPONSE_CLOSE}."
)
# OpenAI's rule for function names; it also keeps names free of JSON escapes.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_HEAD = re.compile(re.escape(CALL_OPEN) + r'\{"name": "([A-Za-z0-9_-]{1,64})", "arguments": ')
_TAIL = "}" + CALL_CLOSE
_JSON = json.JSONDecoder()
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


def tool_use(body: ChatCompletionRequest) -> ToolUse | None:
    """The request's tools and tool_choice, checked; None when it offers none."""
    if not body.tools:
        if body.tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice needs tools", "tool_choice")
        return None
    if len(body.tools) > MAX_TOOLS:
        raise InvalidRequestError(f"at most {MAX_TOOLS} tools are accepted", "tools")
    tools = tuple(_tool(i, t) for i, t in enumerate(body.tools))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tool names must be distinct", "tools")
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or name not in names:
            raise InvalidRequestError("tool_choice must name one of the tools' functions", "tool_choice")
        return ToolUse(tools, str(name), body.parallel_tool_calls)
    if choice not in ("none", "auto", "required"):
        raise InvalidRequestError(
            "tool_choice must be none, auto, required or {type: function, function: {name}}", "tool_choice"
        )
    return ToolUse(tools, str(choice), body.parallel_tool_calls)


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it; `arguments` verbatim, so a generated call renders back exactly."""
    return f'{CALL_OPEN}{{"name": "{name}", "arguments": {arguments}}}{CALL_CLOSE}'


def _system_text(use: ToolUse) -> str:
    lines = [
        json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters})
        for t in use.tools
    ]
    return TOOLS_HEADER + "\n".join(lines) + "\n" + CALL_HOWTO


def _assistant_text(message: ChatMessage) -> str:
    calls = [call_text(c.function.name, c.function.arguments) for c in message.tool_calls or () if c.function]
    return "\n".join(([message.text] if message.text else []) + calls)


def conversation(messages: Sequence[ChatMessage], use: ToolUse | None) -> list[dict[str, str]]:
    """The messages as the chat template sees them: tools in the system prompt, calls and results as
    text in the generic format (a template need not know roles other than system, user, assistant)."""
    out: list[dict[str, str]] = []
    for m in messages:
        if m.role == "tool":
            result = RESPONSE_OPEN + m.text + RESPONSE_CLOSE
            if out and out[-1].get("tool") == "1":
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "tool": "1"})
        elif m.role == "assistant" and m.tool_calls:
            out.append({"role": "assistant", "content": _assistant_text(m)})
        else:
            out.append({"role": m.role, "content": m.text})
    if use is not None:
        if out and out[0]["role"] == "system":
            out[0]["content"] += "\n\n" + _system_text(use)
        else:
            out.insert(0, {"role": "system", "content": _system_text(use)})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with compact JSON, as every constrained output here (a schema may still override)."""
    extra = schema.get("x-guidance")
    guidance = {"whitespace_flexible": False, **(extra if isinstance(extra, dict) else {})}
    return {**schema, "x-guidance": guidance}


def constraint(use: ToolUse) -> StructuredOutputs:
    """The grammar of what the model may answer under `use`."""
    if use.choice == "none":
        return StructuredOutputs(grammar="start: TEXT\n" + r"TEXT: /[^<][\s\S]*/" + "\n")
    tools = [t for t in use.tools if use.choice in ("auto", "required", t.name)]
    rules = []
    for i, t in enumerate(tools):
        head = CALL_OPEN + f'{{"name": "{t.name}", "arguments": '
        rules.append(f"call_{i}: {json.dumps(head)} args_{i} {json.dumps(_TAIL)}")
        rules.append(f"args_{i}: %json {json.dumps(_strict(t.parameters))}")
    calls = 'call ("\\n" call)*' if use.parallel and use.choice in ("auto", "required") else "call"
    start = f"start: {calls}" + (" | TEXT" if use.choice == "auto" else "")
    lines = [start, "call: " + " | ".join(f"call_{i}" for i in range(len(tools))), *rules]
    if use.choice == "auto":
        lines.append(r"TEXT: /[^<][\s\S]*/")
    return StructuredOutputs(grammar="\n".join(lines) + "\n")


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str


def _parse_one(text: str, pos: int) -> tuple[ParsedCall, int] | None:
    """The call starting at `pos` and where it ends, or None if it is not (yet) complete."""
    head = _HEAD.match(text, pos)
    if head is None:
        return None
    try:
        _, end = _JSON.raw_decode(text, head.end())
    except ValueError:
        return None
    if not text.startswith(_TAIL, end):
        return None
    return ParsedCall(head.group(1), text[head.end() : end]), end + len(_TAIL)


def _leading_calls(text: str) -> tuple[list[ParsedCall], int]:
    """The complete calls at the start of `text`, one per line, and where the last of them ends."""
    calls: list[ParsedCall] = []
    pos = end = 0
    while (parsed := _parse_one(text, pos)) is not None:
        call, end = parsed
        calls.append(call)
        if not text.startswith("\n", end):
            break
        pos = end + 1
    return calls, end


def parse_calls(text: str) -> list[ParsedCall] | None:
    """The calls of a reply made only of calls (one per line); None for a reply that is anything else."""
    calls, end = _leading_calls(text)
    return calls if calls and end == len(text) else None


def is_call_text(text: str) -> bool:
    """Whether a reply is in calls mode: under every tool choice a text reply cannot start with `<`."""
    return text.startswith("<")


def complete_calls(text: str) -> list[ParsedCall]:
    """The calls a reply cut short (by max_tokens or the context) completed before it ended: the
    unfinished last one is dropped."""
    return _leading_calls(text)[0] if is_call_text(text) else []


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallStream:
    """Turns one choice's text deltas into OpenAI's chunk deltas: `content` for a plain reply, or
    `tool_calls` entries (first the id and name with empty arguments, then argument pieces)."""

    text: str = ""
    mode: str | None = None
    num_calls: int = 0
    _pos: int = 0
    _args_start: int | None = None
    _sent: int = 0
    ids: list[str] = field(default_factory=list)

    def push(self, delta: str) -> dict[str, Any]:
        self.text += delta
        if self.mode is None and self.text:
            self.mode = "calls" if is_call_text(self.text) else "text"
        if self.mode == "text":
            return {"content": delta} if delta else {}
        entries: dict[int, dict[str, Any]] = {}
        while self.mode == "calls":
            if self._args_start is None:
                if self.text.startswith("\n", self._pos):
                    self._pos += 1
                head = _HEAD.match(self.text, self._pos)
                if head is None:
                    break
                self.ids.append(new_call_id())
                entries[self.num_calls] = {
                    "index": self.num_calls,
                    "id": self.ids[-1],
                    "type": "function",
                    "function": {"name": head.group(1), "arguments": ""},
                }
                self._args_start = self._sent = head.end()
            parsed = _parse_one(self.text, self._pos)
            # A complete call sends the rest of its arguments; an incomplete one all but what may
            # still turn out to be the closing `}</tool_call>`.
            end = self._args_start + len(parsed[0].arguments) if parsed else len(self.text) - len(_TAIL)
            if end > self._sent:
                entry = entries.setdefault(
                    self.num_calls, {"index": self.num_calls, "function": {"arguments": ""}}
                )
                entry["function"]["arguments"] += self.text[self._sent : end]
                self._sent = end
            if parsed is None:
                break
            self.num_calls += 1
            self._pos = parsed[1]
            self._args_start = None
        return {"tool_calls": list(entries.values())} if entries else {}
