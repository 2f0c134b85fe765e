"""What a request's replies are made of, whichever API shapes them: each choice as it grows, the
ids every chunk repeats, the token counts, and a reply parsed into its think block, content and tool
calls (whole, or piece by piece as it streams).

An API's writer (server/openai/formats.py, server/anthropic/serving.py, server/responses/serving.py)
shapes these into its own objects; the parse is the same for all of them.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel

from kvserve.engine.logprobs import TokenLogprob
from kvserve.engine.outputs import PromptOutputs, SampleOutput
from kvserve.server.core import harmony
from kvserve.server.core.cache_report import CacheReport
from kvserve.server.core.harmony import HarmonyStream
from kvserve.server.core.plan import PlannedPrompt
from kvserve.server.core.reasoning import ReasoningStream, split
from kvserve.server.core.tool_formats.layout import ParsedCall
from kvserve.server.core.tool_formats.syntax import CallStreamer, CallSyntax


@dataclass(frozen=True)
class Choice:
    """One choice as it grows: sample `sample` of its prompt's outputs, which the deltas fold into (the
    text and logprobs so far, the prompt's logprobs once computed)."""

    index: int
    prompt: PlannedPrompt
    outputs: PromptOutputs
    sample: int

    @property
    def output(self) -> SampleOutput:
        return self.outputs.samples[self.sample]

    @property
    def text(self) -> str:
        return self.output.text

    @property
    def finish_reason(self) -> str | None:
        return self.output.finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob]:
        return self.output.logprobs

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        return self.outputs.prompt_logprobs


@dataclass(frozen=True)
class ResponseIds:
    """What every chunk of one response repeats."""

    id: str
    created: int
    model: str


@dataclass(frozen=True)
class TokenUsage:
    """A response's token counts: each prompt once, however many samples share it, with the tokens
    the prefix cache held before the request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # What the request's cache breakpoints kept past the cached tokens (server/core/retention.py).
    cache_write_tokens: int = 0
    # The request's cache report, where its API shows it (server/core/cache_report.py).
    cache_report: CacheReport | None = None


class OutputFormat(Protocol):
    """How one API shapes a response of choices, whole or as stream chunks (server/openai/serving.py)."""

    id_prefix: str

    def opening(self, ids: ResponseIds, choices: Sequence[Choice]) -> list[BaseModel]: ...

    def chunk(
        self,
        ids: ResponseIds,
        choice: Choice,
        text: str,
        logprobs: Sequence[TokenLogprob],
        finish_reason: str | None,
    ) -> BaseModel: ...

    def usage_chunk(self, ids: ResponseIds, usage: TokenUsage) -> BaseModel: ...

    def response(self, ids: ResponseIds, choices: Sequence[Choice], usage: TokenUsage) -> BaseModel: ...

    def reply_part(self, choice: Choice) -> str | tuple[str, ...] | None:
        """What of a finished choice's text its client sends back as content, when that is not the
        whole text (a reasoning reply without its think block), or the keys a harmony reply comes back
        under."""
        ...


@dataclass(frozen=True)
class ParsedReply:
    """A finished reply: its think block, its content (None for a reply of calls, or an empty one
    with reasoning on), its calls (None when it is not made of calls) and its finish reason ("tool_calls"
    for a reply that ended in calls)."""

    content: str | None
    reasoning: str | None
    calls: list[ParsedCall] | None
    finish_reason: str | None


@dataclass
class _ChoiceStream:
    """One streamed choice's parsers: its think block first, then its calls or content."""

    reasoning: ReasoningStream | None
    calls: CallStreamer | None


class ReplyParser:
    """With `tools` (the request's call syntax), replies made of tool calls are calls; with
    `reasoning`, a reply's think block is reasoning, streamed before the content. `opened`: the prompt
    opened the block. A reply whose calls name a function not among `tool_names` (possible only
    unconstrained) is content. A streamed piece is a delta in OpenAI's chat shape (`reasoning_content`,
    `content`, `tool_calls`), which the other APIs' writers read."""

    def __init__(
        self,
        tools: CallSyntax | None = None,
        reasoning: bool = False,
        opened: bool = False,
        tool_names: frozenset[str] | None = None,
        harmony: bool = False,
    ) -> None:
        self._tools = tools
        self._names = tool_names
        self._reasoning = reasoning
        self._opened = opened
        self._streams: dict[int, _ChoiceStream] = {}
        # A harmony chat's replies (server/core/harmony.py): channels, not think blocks and layouts.
        self._harmony = harmony
        self._harmony_streams: dict[int, HarmonyStream] = {}

    def delta(self, index: int, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """Choice `index`'s next piece of text as a delta, and its finish reason."""
        if self._harmony:
            hs = self._harmony_streams.setdefault(index, HarmonyStream(self._names))
            pieces = hs.push(text, finish_reason is not None)
            if finish_reason == "stop" and hs.num_calls:
                finish_reason = "tool_calls"
            return pieces, finish_reason
        stream = self._streams.setdefault(
            index,
            _ChoiceStream(
                ReasoningStream(self._opened) if self._reasoning else None,
                self._tools.stream() if self._tools is not None else None,
            ),
        )
        reasoning, body = ("", text) if stream.reasoning is None else stream.reasoning.push(text)
        if finish_reason is not None and stream.reasoning is not None:
            more_reasoning, more_body = stream.reasoning.finish()
            reasoning += more_reasoning
            body += more_body
        delta: dict[str, Any] = {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning else {}
        if stream.calls is not None:
            delta.update(stream.calls.push(body))
            held = stream.calls.finish() if finish_reason is not None else ""
            if held:
                delta["content"] = delta.get("content", "") + held
            if finish_reason == "stop" and stream.calls.num_calls > 0:
                finish_reason = "tool_calls"
        elif body:
            delta["content"] = body
        return delta, finish_reason

    def reply_part(self, text: str, prompt: Sequence[int] = ()) -> str | tuple[str, ...] | None:
        """The content after a finished reply's think block, when it has one and content; a harmony
        reply's keys (`harmony.reply_key` of its `prompt`, with its reasoning and without)."""
        if self._harmony:
            channels = harmony.reply(text, self._names)
            return tuple(
                harmony.reply_key(prompt, channels.content, channels.calls, r)
                for r in (channels.reasoning, None)
            )
        if not self._reasoning:
            return None
        parts = split(text, self._opened)
        return parts.content if parts.reasoning is not None and parts.content else None

    def whole(self, text: str, finish_reason: str | None) -> ParsedReply:
        if self._harmony:
            channels = harmony.reply(text, self._names)
            if channels.calls:
                return ParsedReply(channels.content, channels.reasoning, channels.calls, "tool_calls")
            return ParsedReply(channels.content or "", channels.reasoning, None, finish_reason)
        parts = split(text, self._opened) if self._reasoning else None
        reasoning = None if parts is None else parts.reasoning
        body = text if parts is None else parts.content
        content = body if body or not self._reasoning else None
        layout = self._tools
        if layout is not None and finish_reason == "stop":
            calls = layout.parse_calls(body, self._names)
            if calls is not None:
                return ParsedReply(layout.lead(body), reasoning, calls, "tool_calls")
        elif layout is not None and finish_reason == "length" and layout.is_call_text(body):
            # Cut short while calling: the calls it completed, never the markup of the unfinished one.
            return ParsedReply(layout.lead(body), reasoning, layout.complete_calls(body), "length")
        return ParsedReply(content, reasoning, None, finish_reason)
