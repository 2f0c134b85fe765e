"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests ignore fields they do not know, so that any OpenAI client works unchanged; sampling values are
only type-checked here, their ranges are SamplingParams' to judge. Responses carry OpenAI's exact field
names, including the ones that are always null here (logprobs, refusal), because clients index them.
"""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.server.limits import (
    MAX_CACHE_SALT_CHARS,
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
)

StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
# vLLM's field: splits a request's cache namespace further, within its tenant's (never across tenants).
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextContentPart(OpenAIRequest):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIRequest):
    role: Literal["system", "user", "assistant"]
    content: str | Annotated[list[TextContentPart], Field(max_length=MAX_CONTENT_PARTS)]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        # Joined as vLLM joins them, so that both servers see the same prompt tokens.
        return "\n".join(part.text for part in self.content)


class StreamOptions(OpenAIRequest):
    include_usage: bool = False


class SamplingRequest(OpenAIRequest):
    """Fields shared by chat and text completions. None means OpenAI's default."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: StopString | list[StopString] | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: CacheSalt | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[int]
    # OpenAI's legacy completions stop at 16 tokens unless told otherwise; an explicit null means no limit.
    max_tokens: int | None = 16


class TokenizeRequest(OpenAIRequest):
    """Either a text prompt or chat messages, tokenized exactly as the completion routes would."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    cache_salt: CacheSalt | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[int]


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    # OpenAI sends only the keys that changed: role in the first chunk, then content.
    delta: dict[str, str]
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    """A whole text completion, or one chunk of a streamed one (OpenAI uses the same object for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str
