"""How chat and text completions shape their choices: whole responses and stream chunks.

A response has one choice per prompt and sample (`index` = prompt * n + sample). Both formats share the
streaming and usage code in serving.py and differ only here: chat sends a role chunk first and OpenAI's
per-token logprobs; text completions echo the prompt on request and use the legacy logprobs lists.
"""

from collections.abc import Sequence

from pydantic import BaseModel

from kvserve.engine.logprobs import TokenLogprob
from kvserve.server.core.messages import FunctionCall, ToolCall
from kvserve.server.core.output import Choice, ReplyParser, ResponseIds, TokenUsage
from kvserve.server.core.tool_formats.layout import ParsedCall
from kvserve.server.core.tool_formats.stream import new_call_id
from kvserve.server.core.tool_formats.syntax import CallSyntax
from kvserve.server.openai.logprobs import LogprobRenderer
from kvserve.server.openai.protocol import (
    AssistantMessage,
    CacheReportModel,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    Usage,
)


def openai_usage(usage: TokenUsage) -> Usage:
    return Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(
            cached_tokens=usage.cached_tokens, cache_write_tokens=usage.cache_write_tokens
        ),
        kvserve_cache_report=None
        if usage.cache_report is None
        else CacheReportModel.model_validate(usage.cache_report.as_dict()),
    )


def _tool_calls(calls: Sequence[ParsedCall]) -> list[ToolCall]:
    return [
        ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls
    ]


class ChatFormat:
    """OpenAI's chat shape of replies parsed by `ReplyParser` (server/core/output.py): calls become
    `tool_calls`, a think block `reasoning_content` (and `reasoning`, vLLM's newer name), streamed as
    reasoning deltas before the content's."""

    id_prefix = "chatcmpl"

    def __init__(
        self,
        renderer: LogprobRenderer,
        logprobs: bool,
        tools: CallSyntax | None = None,
        reasoning: bool = False,
        opened: bool = False,
        tool_names: frozenset[str] | None = None,
        harmony: bool = False,
    ) -> None:
        self._renderer = renderer
        self._logprobs = logprobs
        self._parser = ReplyParser(tools, reasoning, opened, tool_names, harmony)

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
        delta, finish_reason = self._parser.delta(choice.index, text, finish_reason)
        piece = ChatChunkChoice(
            index=choice.index, delta=delta, logprobs=self._render(logprobs), finish_reason=finish_reason
        )
        return self._chunk(ids, [piece])

    def reply_part(self, choice: Choice) -> str | tuple[str, ...] | None:
        return self._parser.reply_part(choice.text, choice.prompt.token_ids)

    def _message(self, choice: Choice) -> tuple[AssistantMessage, str | None]:
        reply = self._parser.whole(choice.text, choice.finish_reason)
        calls = None if reply.calls is None else _tool_calls(reply.calls) or None
        message = AssistantMessage(
            content=reply.content,
            tool_calls=calls,
            reasoning_content=reply.reasoning,
            reasoning=reply.reasoning,
        )
        return message, reply.finish_reason

    def usage_chunk(self, ids: ResponseIds, usage: TokenUsage) -> BaseModel:
        return self._chunk(ids, [], openai_usage(usage))

    def response(self, ids: ResponseIds, choices: Sequence[Choice], usage: TokenUsage) -> BaseModel:
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
            id=ids.id, created=ids.created, model=ids.model, choices=out, usage=openai_usage(usage)
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

    def usage_chunk(self, ids: ResponseIds, usage: TokenUsage) -> BaseModel:
        return self._response(ids, [], openai_usage(usage))

    def response(self, ids: ResponseIds, choices: Sequence[Choice], usage: TokenUsage) -> BaseModel:
        out = []
        for c in choices:
            text, rendered = self._piece(c, c.text, c.logprobs, first=True)
            out.append(
                CompletionChoice(index=c.index, text=text, logprobs=rendered, finish_reason=c.finish_reason)
            )
        return self._response(ids, out, openai_usage(usage))

    @staticmethod
    def _response(
        ids: ResponseIds, choices: list[CompletionChoice], usage: Usage | None = None
    ) -> CompletionResponse:
        return CompletionResponse(
            id=ids.id, created=ids.created, model=ids.model, choices=choices, usage=usage
        )
