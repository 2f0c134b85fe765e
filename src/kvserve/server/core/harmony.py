"""gpt-oss's harmony format, in and out: a reply is a run of messages, each a header, `<|message|>` and a
body ended by `<|end|>` (more follows), `<|call|>` (a tool call) or `<|return|>` (the reply is done):

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{ARGS}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

(the prompt's `<|start|>assistant` opens the first). The analysis channel is the reply's reasoning,
a commentary message to `functions.NAME` a tool call, the final channel (and commentary to no one, a
preamble) its content. Markup is special tokens, kept in the text of a harmony chat's replies
(ChatSetup.keep_special_tokens) so that it can be parsed here. Nothing here raises on any text: a
header without a channel, a body never ended, arguments that are not JSON or a function outside the
request's tools are just not calls.

The model's chat template renders the conversation; it drops a past turn's analysis and writes a call's
header in another order than the model does, so a re-rendered history would not be the tokens whose KV
the cache holds. `encode` splices each earlier reply back as the ids the model wrote (reasoning
included) where the template renders that assistant turn: the reply memory keeps the reply under
`reply_key` (its content and calls, as the client sends them back) and the next turn reads all of the
previous one's KV.
"""

import array
import hashlib
import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.grammar import StructuredOutputs
from kvserve.model.tokenizer import MessageDict, Tokenizer
from kvserve.server.core.tool_formats.layout import NAME_PATTERN, ParsedCall, json_end

START = "<|start|>"
END = "<|end|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
RETURN = "<|return|>"
CALL = "<|call|>"
MARKUP = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
_ENDS = (END, CALL, RETURN, START)
# The API's reasoning efforts, as the template's `reasoning_effort` variable takes them.
EFFORTS = ("low", "medium", "high")
# What starts a reply key: no content a client sends back starts so.
_KEY = "\x00harmony\x00"
_TURN_KEY = "kvserve_reply_key"
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z0-9_]+)")
_FUNCTION = re.compile(r"functions\.(" + NAME_PATTERN + r")")


def is_harmony(template: str | None) -> bool:
    """Whether a chat template writes harmony (gpt-oss's): its channels and message markup."""
    return template is not None and CHANNEL in template and MESSAGE in template and START in template


@dataclass(frozen=True)
class Message:
    """One message of a reply: its channel ("" where the header names none), its recipient, its body
    and whether the body was ended (by `<|end|>`, `<|call|>` or `<|return|>`)."""

    channel: str
    recipient: str | None
    body: str
    complete: bool


def messages(text: str) -> tuple[list[Message], bool]:
    """The reply's messages, and whether the text holds harmony markup at all (a reply without any is
    plain content). A last header not yet ended by `<|message|>` is left out."""
    if not any(m in text for m in (CHANNEL, MESSAGE)):
        return [], False
    out: list[Message] = []
    pos = 0
    while pos < len(text):
        header_end = text.find(MESSAGE, pos)
        if header_end < 0:
            break
        header = text[pos:header_end]
        start = header_end + len(MESSAGE)
        ends = [(i, m) for m in _ENDS if (i := text.find(m, start)) >= 0]
        end, marker = min(ends) if ends else (len(text), "")
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        out.append(
            Message(
                channel[1] if channel else "",
                recipient[1] if recipient else None,
                text[start:end],
                marker in (END, CALL, RETURN),
            )
        )
        if marker in ("", RETURN, CALL):
            break
        pos = end + len(marker)
        if marker == END:
            if not text.startswith(START, pos):
                break
            pos += len(START)
        # A header's role ("assistant") is read with it; only channel and recipient matter.
    return out, True


def _call(message: Message, names: frozenset[str] | None, final: bool) -> ParsedCall | None:
    """The call a message makes: a reply's stop token (`<|call|>`) is not in its text, so the last
    message of a finished reply counts as ended."""
    if not (message.complete or final) or message.recipient is None:
        return None
    m = _FUNCTION.fullmatch(message.recipient)
    if m is None or (names is not None and m[1] not in names):
        return None
    body = message.body.strip()
    if not body or json_end(body, 0) != len(body):
        return None
    return ParsedCall(m[1], body)


@dataclass(frozen=True)
class Reply:
    """A reply's reasoning (analysis), content (final and preambles) and tool calls."""

    reasoning: str | None
    content: str | None
    calls: list[ParsedCall]


def _partial_markup(body: str) -> int:
    """How much of the end of a body still being written may be the start of a markup token."""
    at = body.rfind("<", max(0, len(body) - 16))
    return len(body) - at if at >= 0 and any(m.startswith(body[at:]) for m in MARKUP) else 0


def reply(text: str, names: frozenset[str] | None = None, final: bool = True) -> Reply:
    """The parts of a reply's text; with `final` False, of a reply still being written (a body's end
    that may be markup held back)."""
    parsed, markup = messages(text)
    if not markup:
        keep = 0 if final else _partial_markup(text)
        return Reply(None, text[: len(text) - keep] or None, [])
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[ParsedCall] = []
    for m in parsed:
        body = m.body if m.complete or final else m.body[: len(m.body) - _partial_markup(m.body)]
        if m.channel == "analysis":
            reasoning.append(body)
        elif m.recipient is None and m.channel in ("final", "commentary"):
            content.append(body)
        else:
            call = _call(m, names, final)
            if call is not None:
                calls.append(call)
    return Reply(
        "\n\n".join(reasoning) if reasoning else None, "\n\n".join(content) if content else None, calls
    )


def _parts(content: str | None, calls: Sequence[ParsedCall], reasoning: str | None) -> str:
    return json.dumps([reasoning or None, content or "", [[c.name, _compact(c.arguments)] for c in calls]])


def _compact(arguments: str) -> str:
    """A call's arguments as one JSON form (an API that sends them back as an object re-serializes
    them: Anthropic's `input`), or as they are where they are not JSON."""
    try:
        return json.dumps(json.loads(arguments), separators=(",", ":"), ensure_ascii=False)
    except (ValueError, RecursionError):
        return arguments


def reply_key(
    prompt: Sequence[int], content: str | None, calls: Sequence[ParsedCall], reasoning: str | None
) -> str:
    """What the reply memory keeps a harmony reply under: the prompt it answered (a digest of its ids)
    and its reasoning, content and calls as a client sends the reply back; with `reasoning` None, its
    content and calls alone, for a client that drops the reasoning (the splice brings it back as the
    model wrote it). The prompt makes the key exact: two turns of an agent loop that wrote the same
    text in other tokens are two replies."""
    return _key(prompt, _parts(content, calls, reasoning))


def is_reply_key(text: str) -> bool:
    return text.startswith(_KEY)


def _key(prompt: Sequence[int], parts: str) -> str:
    digest = hashlib.sha256(array.array("q", prompt).tobytes()).hexdigest()[:32]
    return _KEY + digest + parts


@dataclass
class HarmonyStream:
    """A reply's text deltas as reasoning, content and calls deltas, in OpenAI's chunk shape; the same
    parts as `reply` once the reply has ended."""

    names: frozenset[str] | None = None
    text: str = ""
    _reasoning: int = 0
    _content: int = 0
    num_calls: int = 0
    ids: list[str] = field(default_factory=list)

    def push(self, delta: str, finished: bool = False) -> dict[str, Any]:
        self.text += delta
        parts = reply(self.text, self.names, final=finished)
        out: dict[str, Any] = {}
        reasoning, content = parts.reasoning or "", parts.content or ""
        if len(reasoning) > self._reasoning:
            out["reasoning_content"] = out["reasoning"] = reasoning[self._reasoning :]
            self._reasoning = len(reasoning)
        if len(content) > self._content:
            out["content"] = content[self._content :]
            self._content = len(content)
        entries = []
        for call in parts.calls[self.num_calls :]:
            self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
            entries.append(
                {
                    "index": self.num_calls,
                    "id": self.ids[-1],
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            )
            self.num_calls += 1
        if entries:
            out["tool_calls"] = entries
        return out


def harmony_turn(role: str, content: str, reasoning: str | None, calls: Sequence[ParsedCall]) -> MessageDict:
    """An assistant turn as gpt-oss's template takes it: `thinking` for the analysis, and the first call
    (the template renders one per turn) with its arguments as an object, which it writes as JSON."""
    # The key rides on the turn (the template reads only the fields it knows).
    turn: MessageDict = {"role": role, _TURN_KEY: _parts(content, calls[:1], reasoning)}
    if calls:
        call = calls[0]
        try:
            arguments: Any = json.loads(call.arguments)
        except ValueError:
            arguments = call.arguments
        turn["tool_calls"] = [
            {
                "type": "function",
                "function": {"name": call.name, "arguments": arguments, "raw_arguments": call.arguments},
            }
        ]
        if content:
            # The template takes a call turn's analysis from its content or its thinking, not both.
            turn["content"] = content
            return turn
    else:
        turn["content"] = content
    if reasoning:
        turn["thinking"] = reasoning
    return turn


def constraint(tools: Sequence[tuple[str, dict[str, Any]]], choice: str) -> StructuredOutputs:
    """The grammar of a harmony reply under tools (name, JSON schema): an optional analysis message, then
    one call in the model's own header form, or (tool_choice auto) a final answer."""
    rules = []
    for i, (name, schema) in enumerate(tools):
        head = json.dumps(f"commentary to=functions.{name} ")
        rules.append(f'call_{i}: <|channel|> {head} <|constrain|> "json" <|message|> args_{i}')
        rules.append(
            f"args_{i}: %json {json.dumps({**schema, 'x-guidance': {'whitespace_flexible': False}})}"
        )
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    body = f"({calls} | final)" if choice == "auto" else f"({calls})"
    lines = [
        f"start: analysis? {body}",
        'analysis: <|channel|> "analysis" <|message|> THINK <|end|> <|start|> "assistant"',
        "THINK: /(?s:.+)/",
        'final: <|channel|> "final" <|message|> /(?s:.*)/',
        *rules,
    ]
    return StructuredOutputs(grammar="\n".join(lines) + "\n")


def _assistant_runs(text: str) -> list[tuple[int, int]]:
    """The runs of consecutive assistant messages in a rendered conversation: (where the first's
    `<|start|>` is, where the last's terminator is). The generation prompt's open message is not one."""
    runs: list[tuple[int, int]] = []
    pos, after_assistant = 0, -1
    while (at := text.find(START, pos)) >= 0:
        header_end = text.find(MESSAGE, at)
        if header_end < 0:
            break
        ends = [(i, m) for m in (END, CALL, RETURN) if (i := text.find(m, header_end)) >= 0]
        if not ends:
            break
        end, marker = min(ends)
        if text.startswith("assistant", at + len(START)):
            if runs and after_assistant == at:
                runs[-1] = (runs[-1][0], end)
            else:
                runs.append((at, end))
            after_assistant = end + len(marker)
        pos = end + len(marker)
    return runs


def encode(
    tokenizer: Tokenizer,
    turns: Sequence[MessageDict],
    text: str,
    lookup: Callable[[str], Sequence[int] | None],
) -> list[int]:
    """The ids of a rendered harmony conversation, each earlier reply the reply memory knows (`lookup`
    of its `reply_key` under the ids before it) spliced in as the ids the model wrote: between the
    `<|start|>assistant` that opened it and the terminator the template writes after it (`<|end|>` or
    `<|call|>`, where the model's own `<|return|>` or `<|call|>` ended the reply). The template renders
    each assistant turn as one run of assistant messages; where the runs do not pair with the turns,
    nothing is spliced."""
    assistants = [t for t in turns if t.get("role") == "assistant"]
    runs = _assistant_runs(text)
    if not assistants or len(runs) != len(assistants):
        return tokenizer.encode(text, add_special_tokens=False)
    ids: list[int] = []
    pos = 0
    opener = START + "assistant"
    for turn, (start, end) in zip(assistants, runs, strict=True):
        if not text.startswith(opener, start):
            continue
        head = ids + tokenizer.encode(text[pos : start + len(opener)], add_special_tokens=False)
        known = lookup(_key(head, str(turn.get(_TURN_KEY, ""))))
        if known is not None:
            ids = head + list(known)
            pos = end
    return ids + tokenizer.encode(text[pos:], add_special_tokens=False)
