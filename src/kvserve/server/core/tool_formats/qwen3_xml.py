"""Qwen3.5 and Qwen3-Coder: calls in XML, each parameter's value as raw text,

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

several calls one per line, after optional text and a blank line (`TEXT\\n\\n<tool_call>...`); the
template lists the tools as JSON in `<tools></tools>` and renders results as `<tool_response>` in user
turns.

A value's type comes from the tool's schema: a string property's text is the string; any other
property's text is its JSON when it parses, else the string (`bind` reads the schemas). The arguments
go out as compact JSON (`{"KEY":VALUE}`, the form Anthropic's input is serialized back in), non-string
values as the model wrote them, so writing them back (`reply_text`) gives the very text the model wrote
and turn 2 reads turn 1's KV. The grammar forces that text: schema order, required parameters present,
`%json` for typed values, raw text up to the first `\\n</parameter>\\n` for strings. The parser is
lenient (any whitespace between tags, values without their newlines) and never raises.
"""

import json
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvserve.errors import InvalidRequestError
from kvserve.server.core.tool_formats.base import ToolFormat
from kvserve.server.core.tool_formats.layout import NAME_PATTERN, ParsedCall, strict_schema
from kvserve.server.core.tool_formats.stream import new_call_id
from kvserve.server.core.tool_formats.syntax import ToolSchema

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
PARAM_CLOSE = "</parameter>"
# What a reply writes between its text and its first call.
LEAD_SEP = "\n\n"
_HEAD = re.compile(r"\s*<tool_call>\s*<function=([^>\n]*)>")
_PARAM = re.compile(r"\s*<parameter=([^>\n]*)>")
_CLOSE = re.compile(r"\s*</function>\s*</tool_call>")
_NAME = re.compile(NAME_PATTERN)
_DECODER = json.JSONDecoder()
# Types keyed by tool, then by parameter: whether the value is a string (else JSON when it parses).
Types = Mapping[str, Mapping[str, bool]]


def _is_string(schema: Any) -> bool:
    """A property whose value is a string: its type says so, or it has no type and a string enum."""
    if not isinstance(schema, dict):
        return False
    kind, enum = schema.get("type"), schema.get("enum")
    if kind is None and isinstance(enum, list) and enum:
        return all(isinstance(v, str) for v in enum)
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def _escaped(text: str) -> str:
    """`text` as the inside of a JSON string (character by character, so pieces concatenate)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _json_value(text: str) -> str:
    """A typed value's JSON: the text as written when it is JSON, else the text as a JSON string."""
    try:
        json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return json.dumps(text, ensure_ascii=False)
    return text.strip()


def _value(raw: str) -> str:
    """A parameter's value: its text without the newline after the tag and the one before the close."""
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


def _held(text: str, *marks: str) -> int:
    """How many of `text`'s last characters could begin one of `marks` (held back while streaming)."""
    return max(
        (k for m in marks for k in range(min(len(m), len(text)), 0, -1) if text.endswith(m[:k])), default=0
    )


class _Scan(NamedTuple):
    """A call read from `pos`: its name (None while its head is incomplete or not a call's), its
    arguments' JSON as far as the text settles it, and where it ends (None while it has not)."""

    name: str | None
    arguments: str
    end: int | None


def _scan(text: str, pos: int, types: Types) -> _Scan:
    head = _HEAD.match(text, pos)
    if head is None or not _NAME.fullmatch(head.group(1)):
        return _Scan(None, "", None)
    name, tool = head.group(1), types.get(head.group(1), {})
    members: list[str] = []
    at = head.end()
    while (param := _PARAM.match(text, at)) is not None:
        key = param.group(1)
        close = text.find(PARAM_CLOSE, param.end())
        string = tool.get(key, True)
        if close < 0:
            # The value so far: a string's settled characters; a typed value waits for its close.
            partial = "{" + "".join(m + "," for m in members) + json.dumps(key, ensure_ascii=False) + ":"
            raw = text[param.end() :]
            if string and raw:
                body = raw[1:] if raw.startswith("\n") else raw
                partial += '"' + _escaped(body[: len(body) - _held(body, "\n" + PARAM_CLOSE, PARAM_CLOSE)])
            return _Scan(name, partial, None)
        value = _value(text[param.end() : close])
        encoded = json.dumps(value, ensure_ascii=False) if string else _json_value(value)
        members.append(json.dumps(key, ensure_ascii=False) + ":" + encoded)
        at = close + len(PARAM_CLOSE)
    end = _CLOSE.match(text, at)
    if end is None:
        return _Scan(name, "{" + ",".join(members) if members else "", None)
    return _Scan(name, "{" + ",".join(members) + "}", end.end())


def _skip(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\n\r":
        pos += 1
    return pos


def _members(arguments: str) -> list[tuple[str, str]] | None:
    """An arguments object's keys, each with its value's JSON text as written; None if it is not an
    object."""
    text = arguments.strip()
    if not text.startswith("{"):
        return None
    out: list[tuple[str, str]] = []
    try:
        pos = _skip(text, 1)
        if text[pos] == "}":
            return out if pos + 1 == len(text) else None
        while True:
            key, pos = _DECODER.raw_decode(text, pos)
            pos = _skip(text, pos)
            if not isinstance(key, str) or text[pos] != ":":
                return None
            start = _skip(text, pos + 1)
            _, pos = _DECODER.raw_decode(text, start)
            out.append((key, text[start:pos]))
            pos = _skip(text, pos)
            if text[pos] == "}":
                return out if pos + 1 == len(text) else None
            if text[pos] != ",":
                return None
            pos = _skip(text, pos + 1)
    except (ValueError, RecursionError, IndexError):
        return None


def _param_text(key: str, value_json: str) -> str:
    """A parameter as the model writes it: a JSON string's characters raw, any other value as written."""
    value = json.loads(value_json) if value_json.startswith('"') else value_json
    return f"<parameter={key}>\n{value}\n{PARAM_CLOSE}\n"


@dataclass(frozen=True)
class XmlCalls:
    """The XML call syntax, with the request's tools' value types once bound (`types`)."""

    types: Types = field(default_factory=dict)

    def bind(self, tools: Sequence[ToolSchema]) -> "XmlCalls":
        types = {}
        for name, parameters in tools:
            props = parameters.get("properties")
            types[name] = {k: _is_string(s) for k, s in props.items()} if isinstance(props, dict) else {}
        return XmlCalls(types)

    def markup(self) -> tuple[str, ...]:
        return (CALL_OPEN, CALL_CLOSE)

    def call_text(self, call: ParsedCall) -> str:
        members = _members(call.arguments)
        if members is None:
            raise InvalidRequestError(
                f"the arguments of a call of {call.name} must be a JSON object to be written as this "
                "model's tool calls",
                "messages",
            )
        params = "".join(_param_text(k, v) for k, v in members)
        return f"{CALL_OPEN}\n<function={call.name}>\n{params}</function>\n{CALL_CLOSE}"

    def calls_text(self, calls: Sequence[ParsedCall]) -> str:
        return "\n".join(self.call_text(c) for c in calls)

    def reply_text(self, content: str, calls: Sequence[ParsedCall]) -> str:
        if not calls:
            return content
        text = content.rstrip()
        return (text + LEAD_SEP if text.strip() else "") + self.calls_text(calls)

    def is_call_text(self, text: str) -> bool:
        return CALL_OPEN in text

    def _calls(self, text: str) -> tuple[list[ParsedCall], int | None]:
        """The complete calls from the first call on, and where the last ends (None: none ended)."""
        pos = text.find(CALL_OPEN)
        calls: list[ParsedCall] = []
        end = None
        while pos >= 0:
            scan = _scan(text, pos, self.types)
            if scan.name is None or scan.end is None:
                break
            calls.append(ParsedCall(scan.name, scan.arguments))
            end = pos = scan.end
        return calls, end

    def parse_calls(self, text: str, names: Collection[str] | None = None) -> list[ParsedCall] | None:
        calls, end = self._calls(text)
        if end is None or text[end:].strip():
            return None
        if names is not None and any(c.name not in names for c in calls):
            return None
        return calls

    def lead(self, text: str) -> str | None:
        at = text.find(CALL_OPEN)
        return (text[:at].rstrip() or None) if at >= 0 else None

    def complete_calls(self, text: str) -> list[ParsedCall]:
        return self._calls(text)[0]

    def stream(self) -> "XmlCallStream":
        return XmlCallStream(self)

    def text_rule(self) -> str:
        """Text with no call in it (text before a call is its lead), not starting as think blocks do."""
        return r"TEXT: /[^<](?s:.*)/ & ~/(?s:.*<tool_call>.*)/"

    def calls_grammar(self, tools: Sequence[ToolSchema], parallel: bool, auto: bool) -> tuple[str, list[str]]:
        """`call ("\\n" call)*`; with `auto`, text before the calls (after a blank line) or TEXT."""
        rules = [
            "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
            "body: " + " | ".join(f"body_{i}" for i in range(len(tools))),
            f"sval[lazy]: /(?s:.*)/ {json.dumps(chr(10) + PARAM_CLOSE + chr(10))}",
        ]
        for i, (name, parameters) in enumerate(tools):
            rules.append(f"call_{i}: {json.dumps(CALL_OPEN)} body_{i}")
            rules += _body_rules(i, name, parameters)
        more = ' ("\\n" call)*' if parallel else ""
        if not auto:
            return f"(call{more})", rules
        # One token for the opening, with or without text before it: the text (no "<" in it, which
        # the library's lexer needs to end it unambiguously) ends at the blank line before the call.
        first = r'FIRST: "<tool_call>" | /[^<\s]([^<]*[^<\s])?/ ' + json.dumps(LEAD_SEP + CALL_OPEN)
        return f"(FIRST body{more} | TEXT)", [*rules, first, self.text_rule()]


def _length(schema: dict[str, Any]) -> str:
    """A string schema's length bounds as a regex repetition, `{MIN,MAX}`."""
    low, high = schema.get("minLength"), schema.get("maxLength")
    low = low if isinstance(low, int) and low > 0 else 0
    return "{" + f"{low},{high if isinstance(high, int) and high >= low else ''}" + "}"


def _body_rules(i: int, name: str, parameters: dict[str, Any]) -> list[str]:
    """A call's rules after its `<tool_call>`: its parameters in the schema's order, the required ones
    present, a string within its schema's length bounds or enum; without properties, any parameters
    as strings."""
    props = parameters.get("properties")
    required = parameters.get("required")
    required = set(required) if isinstance(required, list) else set()
    defs: dict[str, Any] = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    close = json.dumps("\n" + PARAM_CLOSE + "\n")
    rules, parts = [], []
    if isinstance(props, dict):
        for j, (key, schema) in enumerate(props.items()):
            if not isinstance(key, str) or not key or ">" in key or "\n" in key:
                raise InvalidRequestError(
                    f"tool {name}: a parameter name cannot be empty or hold '>' or a newline in this "
                    "model's tool calls",
                    "tools",
                )
            enum = schema.get("enum") if _is_string(schema) else None
            values = [v for v in enum if isinstance(v, str)] if isinstance(enum, list) else []
            if values:
                value = "(" + " | ".join(json.dumps(v) for v in values) + f") {close}"
            elif _is_string(schema) and ("maxLength" in schema or "minLength" in schema):
                rules.append(f"v_{i}_{j}[lazy]: /(?s:.{_length(schema)})/ {close}")
                value = f"v_{i}_{j}"
            elif _is_string(schema):
                value = "sval"
            else:
                sub = strict_schema({**schema, **defs} if isinstance(schema, dict) else {})
                value = f"%json {json.dumps(sub)} {close}"
            rules.append(f"p_{i}_{j}: {json.dumps(f'<parameter={key}>' + chr(10))} {value}")
            parts.append(f"p_{i}_{j}" + ("" if key in required else "?"))
    elif parameters.get("additionalProperties") is not False:
        rules.append(f'p_{i}_any: "<parameter=" /[^>\\n]+/ ">\\n" sval')
        parts.append(f"p_{i}_any*")
    head = json.dumps(f"\n<function={name}>\n")
    tail = json.dumps(f"</function>\n{CALL_CLOSE}")
    return [f"body_{i}: " + " ".join([head, *parts, tail]), *rules]


@dataclass
class XmlCallStream:
    """The XML calls' stream: text before the calls goes out as content (held back where it might
    still be the start of a call, or the whitespace before one); each call's arguments as far as the
    text settles them: a string value character by character, a typed one at its close."""

    syntax: XmlCalls
    text: str = ""
    num_calls: int = 0
    ids: list[str] = field(default_factory=list)
    _content_sent: int = 0
    _pos: int | None = None
    _sent: str | None = None

    def push(self, delta: str) -> dict[str, Any]:
        self.text += delta
        out: dict[str, Any] = {}
        if self._pos is None:
            at = self.text.find(CALL_OPEN)
            if at < 0:
                settled = self.text[: len(self.text) - _held(self.text, CALL_OPEN)].rstrip()
            else:
                settled = self.text[:at].rstrip()
                self._pos = at
            if len(settled) > self._content_sent:
                out["content"] = settled[self._content_sent :]
                self._content_sent = len(settled)
            if self._pos is None:
                return out
        entries: list[dict[str, Any]] = []
        while True:
            scan = _scan(self.text, self._pos, self.syntax.types)
            if scan.name is None:
                break
            if self._sent is None:
                self.ids.append(new_call_id())
                entries.append(
                    {
                        "index": self.num_calls,
                        "id": self.ids[-1],
                        "type": "function",
                        "function": {"name": scan.name, "arguments": ""},
                    }
                )
                self._sent = ""
            piece = scan.arguments[len(self._sent) :]
            if piece:
                if not entries or entries[-1]["index"] != self.num_calls:
                    entries.append({"index": self.num_calls, "function": {"arguments": ""}})
                entries[-1]["function"]["arguments"] += piece
                self._sent = scan.arguments
            if scan.end is None:
                break
            self.num_calls += 1
            self._pos, self._sent = scan.end, None
        if entries:
            out["tool_calls"] = entries
        return out

    def finish(self) -> str:
        """A reply that never called: the text held back is content after all."""
        if self._pos is not None:
            return ""
        rest = self.text[self._content_sent :]
        self._content_sent = len(self.text)
        return rest


QWEN3_XML = ToolFormat("qwen3_xml", XmlCalls(), markers=("<function=", "<parameter="))
