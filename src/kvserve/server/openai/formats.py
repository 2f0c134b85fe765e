"""How chat and text completions shape their choices: whole responses and stream chunks.

A response has one choice per prompt and sample (`index` = prompt * n + sample). Both formats share the
streaming and usage code in serving.py and differ only here: chat sends a role chunk first and OpenAI's
per-token logprobs; text completions echo the prompt on request and use the legacy logprobs lists.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel

from kvserve.engine.logprobs import TokenLogprob
from kvserve.engine.outputs import PromptOutputs, SampleOutput
from kvserve.server.core.plan import PlannedPrompt
from kvserve.server.core.reasoning import ReasoningStream, split
from kvserve.server.core.tool_formats.layout import CallLayout, ParsedCall
from kvserve.server.core.tool_formats.stream import CallStream, new_call_id
from kvserve.server.openai.logprobs import LogprobRenderer
from kvserve.server.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    FunctionCall,
    ToolCall,
    Usage,
)


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


class OutputFormat(Protocol):
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

    def usage_chunk(self, ids: ResponseIds, usage: Usage) -> BaseModel: ...

    def response(self, ids: ResponseIds, choices: Sequence[Choice], usage: Usage) -> BaseModel: ...

    def reply_part(self, choice: Choice) -> str | None:
        """What of a finished choice's text its client sends back as content, when that is not the
        whole text (a reasoning reply without its think block)."""
        ...


def _tool_finish(reason: str | None, calls: bool) -> str | None:
    """OpenAI's finish reason for a reply that ended in tool calls."""
    return "tool_calls" if calls and reason == "stop" else reason


def _tool_calls(calls: Sequence[ParsedCall]) -> list[ToolCall]:
    return [
        ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls
    ]


@dataclass
class _ChoiceStream:
    """One streamed choice's parsers: its think block first, then its calls or content."""

    reasoning: ReasoningStream | None
    calls: CallStream | None


class ChatFormat:
    """With `tools` (the server's call layout), replies made of tool calls become OpenAI `tool_calls`;
    with `reasoning`, a reply's think block becomes `reasoning_content` (and `reasoning`, vLLM's newer
    name), streamed as reasoning deltas before the content's. `opened`: the prompt opened the block. A
    reply whose calls name a function not among `tool_names` (possible only unconstrained) is content."""

    id_prefix = "chatcmpl"

    def __init__(
        self,
        renderer: LogprobRenderer,
        logprobs: bool,
        tools: CallLayout | None = None,
        reasoning: bool = False,
        opened: bool = False,
        tool_names: frozenset[str] | None = None,
    ) -> None:
        self._renderer = renderer
        self._logprobs = logprobs
        self._tools = tools
        self._names = tool_names
        self._reasoning = reasoning
        self._opened = opened
        self._streams: dict[int, _ChoiceStream] = {}

    def _render(self, entries: Sequence[TokenLogprob]) -> ChatLogprobs | None:
        return self._renderer.chat(entries) if self._logprobs else None

    def opening(self, ids: ResponseIds, choices: Sequence[Choice]) -> list[BaseModel]:
        # OpenAI's first chunk of each choice names the role and nothing else.
        return [
            self._chunk(ids, [ChatChunkChoice(index=c.index, delta={"role": "assistant", "content": ""})])
            for c in choices
        ]

    def _body_delta(self, stream: _ChoiceStream, text: str) -> dict[str, Any]:
        if stream.calls is not None:
            return stream.calls.push(text)
        return {"content": text} if text else {}

    def chunk(
        self,
        ids: ResponseIds,
        choice: Choice,
        text: str,
        logprobs: Sequence[TokenLogprob],
        finish_reason: str | None,
    ) -> BaseModel:
        stream = self._streams.setdefault(
            choice.index,
            _ChoiceStream(
                ReasoningStream(self._opened) if self._reasoning else None,
                CallStream(self._tools) if self._tools is not None else None,
            ),
        )
        reasoning, body = ("", text) if stream.reasoning is None else stream.reasoning.push(text)
        if finish_reason is not None and stream.reasoning is not None:
            more_reasoning, more_body = stream.reasoning.finish()
            reasoning += more_reasoning
            body += more_body
        delta: dict[str, Any] = {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning else {}
        delta.update(self._body_delta(stream, body))
        if stream.calls is not None:
            finish_reason = _tool_finish(finish_reason, stream.calls.num_calls > 0)
        piece = ChatChunkChoice(
            index=choice.index, delta=delta, logprobs=self._render(logprobs), finish_reason=finish_reason
        )
        return self._chunk(ids, [piece])

    def reply_part(self, choice: Choice) -> str | None:
        if not self._reasoning:
            return None
        parts = split(choice.text, self._opened)
        return parts.content if parts.reasoning is not None and parts.content else None

    def _message(self, choice: Choice) -> tuple[AssistantMessage, str | None]:
        parts = split(choice.text, self._opened) if self._reasoning else None
        reasoning = None if parts is None else parts.reasoning
        text = choice.text if parts is None else parts.content
        message, finish = self._body(text, choice.finish_reason)
        return message.model_copy(update={"reasoning_content": reasoning, "reasoning": reasoning}), finish

    def _body(self, text: str, finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
        content = text if text or not self._reasoning else None
        layout = self._tools
        if layout is None:
            return AssistantMessage(content=content), finish_reason
        if finish_reason == "stop":
            calls = layout.parse_calls(text, self._names)
            if calls is not None:
                return AssistantMessage(content=None, tool_calls=_tool_calls(calls)), "tool_calls"
        elif finish_reason == "length" and layout.is_call_text(text):
            # Cut short while calling: the calls it completed, never the markup of the unfinished one.
            calls = layout.complete_calls(text)
            return AssistantMessage(content=None, tool_calls=_tool_calls(calls) or None), "length"
        return AssistantMessage(content=content), finish_reason

    def usage_chunk(self, ids: ResponseIds, usage: Usage) -> BaseModel:
        return self._chunk(ids, [], usage)

    def response(self, ids: ResponseIds, choices: Sequence[Choice], usage: Usage) -> BaseModel:
        out = []
        for c in choices:
            message, finish_reason = self._message(c)
            out.append(
                ChatChoice(
                    index=c.index,
                    message=message,
                    logprobs=self._render(c.logprobs),
                    finish_reason=finish_reason,
                )
            )
        return ChatCompletionResponse(
            id=ids.id, created=ids.created, model=ids.model, choices=out, usage=usage
        )

    @staticmethod
    def _chunk(
        ids: ResponseIds, choices: list[ChatChunkChoice], usage: Usage | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=ids.id, created=ids.created, model=ids.model, choices=choices, usage=usage
        )


class CompletionFormat:
    id_prefix = "cmpl"

    def __init__(self, renderer: LogprobRenderer, logprobs: bool, echo: bool) -> None:
        self._renderer = renderer
        self._logprobs = logprobs
        self._echo = echo
        # Per streamed choice: the character offset its next token starts at.
        self._offsets: dict[int, int] = {}

    def opening(self, ids: ResponseIds, choices: Sequence[Choice]) -> list[BaseModel]:
        return []

    def reply_part(self, choice: Choice) -> str | None:
        return None

    def _piece(
        self, choice: Choice, text: str, logprobs: Sequence[TokenLogprob], first: bool
    ) -> tuple[str, CompletionLogprobs | None]:
        """The choice's text and logprobs for this piece; the first piece of an echo starts with the
        prompt."""
        token_ids = [e.token_id for e in logprobs]
        entries: list[TokenLogprob | None] = list(logprobs)
        if first and self._echo:
            text = choice.prompt.text + text
            if choice.prompt_logprobs is not None:
                token_ids = choice.prompt.token_ids + token_ids
                entries = list(choice.prompt_logprobs) + entries
        if not self._logprobs:
            return text, None
        rendered, self._offsets[choice.index] = self._renderer.legacy(
            token_ids, entries, self._offsets.get(choice.index, 0)
        )
        return text, rendered

    def chunk(
        self,
        ids: ResponseIds,
        choice: Choice,
        text: str,
        logprobs: Sequence[TokenLogprob],
        finish_reason: str | None,
    ) -> BaseModel:
        first = choice.index not in self._offsets
        self._offsets.setdefault(choice.index, 0)
        text, rendered = self._piece(choice, text, logprobs, first)
        piece = CompletionChoice(
            index=choice.index, text=text, logprobs=rendered, finish_reason=finish_reason
        )
        return self._response(ids, [piece])

    def usage_chunk(self, ids: ResponseIds, usage: Usage) -> BaseModel:
        return self._response(ids, [], usage)

    def response(self, ids: ResponseIds, choices: Sequence[Choice], usage: Usage) -> BaseModel:
        out = []
        for c in choices:
            text, rendered = self._piece(c, c.text, c.logprobs, first=True)
            out.append(
                CompletionChoice(index=c.index, text=text, logprobs=rendered, finish_reason=c.finish_reason)
            )
        return self._response(ids, out, usage)

    @staticmethod
    def _response(
        ids: ResponseIds, choices: list[CompletionChoice], usage: Usage | None = None
    ) -> CompletionResponse:
        return CompletionResponse(
            id=ids.id, created=ids.created, model=ids.model, choices=choices, usage=usage
        )
