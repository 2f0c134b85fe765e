"""The one implementation under every tool-call format: a format is a `CallLayout` (its literal text around
each call's name and arguments), and writing, parsing, streaming and constraining calls are written
once over it.

A reply in calls mode is `open CALL (sep CALL)* close`, each CALL being
`call_open {"name": "NAME", "KEY": ARGS} call_close`, ARGS the tool's arguments as JSON. The writer
and the grammar use the layout's exact text, so a constrained call comes out exactly as `call_text`
writes it, and renders back exactly (turn 2 then reads turn 1's KV through the call). The parser is
more lenient, for unconstrained output: any whitespace where the layout has whitespace or between JSON
punctuation, a format's aliases before `open` (Llama's `<|python_tag|>`) and its other argument keys.
It never raises: hostile text (malformed JSON, names outside OpenAI's rule or the request's tools,
unterminated markup, deep nesting) is just not a call.
"""

import functools
import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from kvserve.server.core.tool_formats.stream import CallStream

# OpenAI's rule for function names; it also keeps names free of JSON escapes.
NAME_PATTERN = r"[A-Za-z0-9_-]{1,64}"
_JSON = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str


def _flexible(literal: str) -> str:
    """A regex for `literal` that takes any whitespace (or none) where it has whitespace and around
    its JSON punctuation (Mistral's `[TOOL_CALLS] [`)."""
    parts = [p for p in re.split(r"\s+|([\[\]{},;])", literal) if p]
    return r"\s*".join(re.escape(p) for p in parts)


@dataclass(frozen=True)
class CallLayout:
    """The literal text of one format's calls. `key` names the arguments in the written call and
    `other_keys` the names the parser also takes; `aliases` may stand before `open` in what a model
    writes unconstrained."""

    open: str = ""
    call_open: str = ""
    key: str = "arguments"
    call_close: str = ""
    sep: str = "\n"
    close: str = ""
    other_keys: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()

    def head(self, name: str) -> str:
        """A call's text before its arguments."""
        return f'{self.call_open}{{"name": "{name}", "{self.key}": '

    @property
    def tail(self) -> str:
        """A call's text after its arguments."""
        return "}" + self.call_close

    def call_text(self, name: str, arguments: str) -> str:
        """One call as the constrained model writes it; `arguments` verbatim."""
        return self.head(name) + arguments + self.tail

    def calls_text(self, calls: Sequence[ParsedCall]) -> str:
        """A reply made of these calls, exactly as the constrained model writes it."""
        return self.open + self.sep.join(self.call_text(c.name, c.arguments) for c in calls) + self.close

    def bind(self, tools: Sequence[tuple[str, dict[str, Any]]]) -> "CallLayout":
        """The same layout: JSON arguments are the model's own text, whatever the schemas."""
        return self

    def reply_text(self, content: str, calls: Sequence[ParsedCall]) -> str:
        """An assistant message's text, its calls after its content (a constrained reply has only one)."""
        return "\n".join(([content] if content else []) + ([self.calls_text(calls)] if calls else []))

    def lead(self, text: str) -> None:
        """A reply of calls in a JSON format starts with them: it has no content."""
        return None

    def stream(self) -> "CallStream":
        # Imported here: the stream module builds on this one.
        from kvserve.server.core.tool_formats.stream import CallStream

        return CallStream(self)

    def text_rule(self) -> str:
        """A reply that is not calls cannot start as calls do."""
        return "TEXT: /[^" + re.escape(self.first_char) + r"][\s\S]*/"

    def calls_grammar(
        self, tools: Sequence[tuple[str, dict[str, Any]]], parallel: bool, auto: bool
    ) -> tuple[str, list[str]]:
        """`open call (sep call)* close`, each call the layout's head, the tool's arguments as compact
        JSON of its schema, and the tail; with `auto`, or TEXT."""
        rules = ["call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
        for i, (name, parameters) in enumerate(tools):
            rules.append(f"call_{i}: {json.dumps(self.head(name))} args_{i} {json.dumps(self.tail)}")
            rules.append(f"args_{i}: %json {json.dumps(strict_schema(parameters))}")
        calls = f"call ({json.dumps(self.sep)} call)*" if parallel else "call"
        calls = (f"{json.dumps(self.open)} " if self.open else "") + calls
        calls += f" {json.dumps(self.close)}" if self.close else ""
        if not auto:
            return f"({calls})", rules
        return f"({calls} | TEXT)", [*rules, self.text_rule()]

    def markup(self) -> tuple[str, ...]:
        """The literal pieces of the layout's markup (a tokenizer may hold some as special tokens)."""
        return tuple(p for p in (self.open, self.call_open, self.call_close, self.close, *self.aliases) if p)

    @property
    def first_char(self) -> str:
        """What a reply in calls mode starts with; under tool_choice auto or none a text reply cannot."""
        return (self.open + self.call_open + "{")[0]

    def is_call_text(self, text: str) -> bool:
        """Whether a reply is in calls mode (leading whitespace aside)."""
        text = text.lstrip()
        return text.startswith(self.first_char) or any(text.startswith(a) for a in self.aliases)

    def match_open(self, text: str, pos: int) -> int | None:
        m = _regexes(self).open.match(text, pos)
        return None if m is None else m.end()

    def match_head(self, text: str, pos: int) -> tuple[str, int] | None:
        """The call's name and where its arguments start, if a whole head is at `pos` (and the
        arguments have started: until then, whitespace may still follow)."""
        m = _regexes(self).head.match(text, pos)
        return None if m is None else (m.group(1), m.end())

    def parse_call(self, text: str, pos: int) -> tuple[ParsedCall, int, int] | None:
        """The call at `pos`, where its arguments end and where the call ends; None if there is no
        complete call there."""
        head = self.match_head(text, pos)
        if head is None:
            return None
        name, start = head
        end = json_end(text, start)
        if end is None:
            return None
        tail = _regexes(self).tail.match(text, end)
        if tail is None:
            return None
        return ParsedCall(name, text[start:end]), end, tail.end()

    def match_sep(self, text: str, pos: int) -> int | None:
        """Where the next call starts, if a separator and the start of a head follow `pos`."""
        m = _regexes(self).sep.match(text, pos)
        if m is None or self.match_head(text, m.end()) is None:
            return None
        return m.end()

    def match_close(self, text: str, pos: int) -> int | None:
        m = _regexes(self).close.match(text, pos)
        return None if m is None else m.end()

    def leading_calls(self, text: str) -> tuple[list[ParsedCall], int | None]:
        """The complete calls at the start of `text` and where the whole calls part ends (after
        `close`), or None when it does not end there (more calls cut short, no close yet)."""
        pos = self.match_open(text, 0)
        calls: list[ParsedCall] = []
        if pos is None:
            return calls, None
        while (parsed := self.parse_call(text, pos)) is not None:
            call, _, pos = parsed
            calls.append(call)
            after = self.match_sep(text, pos)
            if after is None:
                break
            pos = after
        return calls, self.match_close(text, pos) if calls else None

    def parse_calls(self, text: str, names: Collection[str] | None = None) -> list[ParsedCall] | None:
        """The calls of a reply made only of calls (trailing whitespace aside); None for anything else,
        or when a call names a function that is not among `names` (the request's tools)."""
        calls, end = self.leading_calls(text)
        if not calls or end is None or text[end:].strip():
            return None
        if names is not None and any(c.name not in names for c in calls):
            return None
        return calls

    def complete_calls(self, text: str) -> list[ParsedCall]:
        """The calls a reply cut short (by max_tokens or the context) completed before it ended."""
        return self.leading_calls(text)[0] if self.is_call_text(text) else []


class _Regexes(NamedTuple):
    open: re.Pattern[str]
    head: re.Pattern[str]
    tail: re.Pattern[str]
    sep: re.Pattern[str]
    close: re.Pattern[str]


@functools.cache
def _regexes(layout: CallLayout) -> _Regexes:
    """The parser's regexes of a layout, built once (the layouts are the formats' constants)."""
    alias = "|".join(re.escape(a) for a in layout.aliases)
    keys = "|".join(re.escape(k) for k in (layout.key, *layout.other_keys))
    head = (
        r"\s*"
        + _flexible(layout.call_open)
        + r'\s*\{\s*"name"\s*:\s*"('
        + NAME_PATTERN
        + r')"\s*,\s*"(?:'
        + keys
        + r')"\s*:\s*(?=\S)'
    )
    return _Regexes(
        open=re.compile(r"\s*" + (f"(?:{alias})?" if alias else "") + r"\s*" + _flexible(layout.open)),
        head=re.compile(head),
        tail=re.compile(r"\s*\}\s*" + _flexible(layout.call_close)),
        sep=re.compile(r"\s*" + _flexible(layout.sep.strip()) + r"\s*"),
        close=re.compile(r"\s*" + _flexible(layout.close)),
    )


def strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with compact JSON, as every constrained output here (a schema may still override)."""
    extra = schema.get("x-guidance")
    guidance = {"whitespace_flexible": False, **(extra if isinstance(extra, dict) else {})}
    return {**schema, "x-guidance": guidance}


def json_end(text: str, start: int) -> int | None:
    """Where the JSON value at `start` ends; None if there is none (yet). Never raises: the decoder's
    recursion on deep nesting is a malformed value like any other."""
    try:
        _, end = _JSON.raw_decode(text, start)
    except (ValueError, RecursionError):
        return None
    return int(end)
