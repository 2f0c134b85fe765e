"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests ignore fields they do not know, so that any OpenAI client works unchanged; sampling values are
only type-checked here, their ranges are SamplingParams' to judge. Responses carry OpenAI's exact field
names, including the ones that are always null here (logprobs, refusal), because clients index them.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextContentPart(OpenAIRequest):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIRequest):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextContentPart]

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
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[int]
    # OpenAI's legacy completions stop at 16 tokens unless told otherwise; an explicit null means no limit.
    max_tokens: int | None = 16


class TokenizeRequest(OpenAIRequest):
    """Either a text prompt or chat messages, tokenized exactly as the completion routes would."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
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


# A pin outliving a week is a configuration, not a cache decision.
MAX_PIN_TTL_S = 7 * 24 * 3600


class PinRequest(OpenAIRequest):
    """A prefix to hold in memory: a text prompt (or token ids) or chat messages, rendered without the
    generation prompt so that every later chat that starts with them shares the pinned blocks."""

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    ttl_s: float = Field(gt=0, le=MAX_PIN_TTL_S)


class PinInfo(BaseModel):
    id: str
    object: Literal["cache.pin"] = "cache.pin"
    pinned_tokens: int
    expires_at: int
    expires_in_s: float


class PinDeleted(BaseModel):
    id: str
    object: Literal["cache.pin"] = "cache.pin"
    deleted: bool = True


class TierInfo(BaseModel):
    name: str
    blocks: int
    bytes_used: int
    capacity_bytes: int
    pinned_blocks: int | None = None
    max_pinned_blocks: int | None = None


class CacheStatus(BaseModel):
    object: Literal["cache"] = "cache"
    block_size: int
    pins: list[PinInfo]
    tiers: list[TierInfo]
