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
from kvserve.server.logprobs import LogprobRenderer
from kvserve.server.plan import PlannedPrompt
from kvserve.server.protocol import (
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
from kvserve.server.tools import (
    ParsedCall,
    ToolCallStream,
    complete_calls,
    is_call_text,
    new_call_id,
    parse_calls,
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


def _tool_finish(reason: str | None, calls: bool) -> str | None:
    """OpenAI's finish reason for a reply that ended in tool calls."""
    return "tool_calls" if calls and reason == "stop" else reason


def _tool_calls(calls: Sequence[ParsedCall]) -> list[ToolCall]:
    return [
        ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls
    ]


class ChatFormat:
    """With `tools`, replies made of tool calls (server/tools.py) become OpenAI `tool_calls`."""

    id_prefix = "chatcmpl"

    def __init__(self, renderer: LogprobRenderer, logprobs: bool, tools: bool = False) -> None:
        self._renderer = renderer
        self._logprobs = logprobs
        self._tools = tools
        # Per streamed choice: its text so far, parsed into content or tool-call deltas.
        self._streams: dict[int, ToolCallStream] = {}

    def _render(self, entries: Sequence[TokenLogprob]) -> ChatLogprobs | None:
        return self._renderer.chat(entries) if self._logprobs else None

    def opening(self, ids: ResponseIds, choices: Sequence[Choice]) -> list[BaseModel]:
        # OpenAI's first chunk of each choice names the role and nothing else.
        return [
            self._chunk(ids, [ChatChunkChoice(index=c.index, delta={"role": "assistant", "content": ""})])
            for c in choices
        ]

    def chunk(
        self,
        ids: ResponseIds,
        choice: Choice,
        text: str,
        logprobs: Sequence[TokenLogprob],
        finish_reason: str | None,
    ) -> BaseModel:
        delta: dict[str, Any] = {"content": text} if text else {}
        if self._tools:
            stream = self._streams.setdefault(choice.index, ToolCallStream())
            delta = stream.push(text)
            finish_reason = _tool_finish(finish_reason, stream.num_calls > 0)
        piece = ChatChunkChoice(
            index=choice.index, delta=delta, logprobs=self._render(logprobs), finish_reason=finish_reason
        )
        return self._chunk(ids, [piece])

    def _message(self, choice: Choice) -> tuple[AssistantMessage, str | None]:
        if not self._tools:
            return AssistantMessage(content=choice.text), choice.finish_reason
        if choice.finish_reason == "stop":
            calls = parse_calls(choice.text)
            if calls is not None:
                return AssistantMessage(content=None, tool_calls=_tool_calls(calls)), "tool_calls"
        elif choice.finish_reason == "length" and is_call_text(choice.text):
            # Cut short while calling: the calls it completed, never the markup of the unfinished one.
            calls = complete_calls(choice.text)
            return AssistantMessage(content=None, tool_calls=_tool_calls(calls) or None), "length"
        return AssistantMessage(content=choice.text), choice.finish_reason

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
