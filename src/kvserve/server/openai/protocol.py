"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests ignore fields they do not know, so that any OpenAI client works unchanged; fields that would
change the answer and are not supported (images, audio, legacy functions) are parsed so that
`server/openai/unsupported.py` can refuse them by name. Sampling values are only type-checked here, their
ranges are SamplingParams' to judge. Responses carry OpenAI's exact field names, including the ones that are
always null here (refusal), because clients index them.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, TypeAdapter, ValidatorFunctionWrapHandler, WrapValidator

from kvserve.server.core.messages import (
    MAX_MESSAGES,
    ChatMessage,
    RequestModel,
    StopString,
    ToolCall,
)

# Field limits of the protocol; each is far above what a real client sends.
MAX_STOP_TOKEN_IDS = 256
MAX_CACHE_SALT_CHARS = 256

# vLLM's field: splits a request's cache namespace further, within its tenant's (never across tenants).
CacheSalt = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]


# OpenAI's bodies ignore fields they do not know, as every request here does.
OpenAIRequest = RequestModel


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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # OpenAI sends token ids as JSON object keys, hence strings.
    logit_bias: dict[str, float] | None = None
    # kvserve's: the request's cache report in its usage (server/core/cache_report.py); off, as OpenAI.
    kvserve_cache_report: bool = False
    # vLLM's extras.
    min_tokens: int = 0
    repetition_penalty: float | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Structured outputs, in OpenAI's and vLLM's dialects (server/core/structured.py).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    cache_salt: CacheSalt | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Checked by server/core/tools.py.
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    # Variables for the chat template (e.g. {"enable_thinking": false}), checked by server/core/prompts.py.
    chat_template_kwargs: dict[str, Any] | None = None
    # low, medium or high: the template's `reasoning_effort` (gpt-oss's system message), unless
    # chat_template_kwargs sets it.
    reasoning_effort: str | None = None
    # Checked by server/core/prompt_cache.py.
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    # The legacy function-calling fields, refused by name.
    functions: list[Any] | None = None
    function_call: Any = None


_TOKEN_ID_BATCH = TypeAdapter(list[list[int]])
_TEXT_BATCH = TypeAdapter(list[str])


def _batch_by_first(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A batch is validated as the kind its first prompt is. Tried in turn, the union would validate a
    batch of 100,000 token-id lists as a list of ints and as a list of strings first, each failing on
    every element."""
    if isinstance(value, list) and value and isinstance(value[0], list):
        return _TOKEN_ID_BATCH.validate_python(value)
    if isinstance(value, list) and value and isinstance(value[0], str):
        return _TEXT_BATCH.validate_python(value)
    return handler(value)


class CompletionRequest(SamplingRequest):
    # One prompt (text or token ids) or a batch of them.
    prompt: Annotated[str | list[int] | list[str] | list[list[int]], WrapValidator(_batch_by_first)]
    # OpenAI's legacy completions stop at 16 tokens unless told otherwise; an explicit null means no limit.
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


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
    # What this request computed that its cache breakpoints keep (server/core/prompt_cache.py).
    cache_write_tokens: int = 0


class CacheReportModel(BaseModel):
    """kvserve's cache report (server/core/cache_report.py): what was found cached, what was computed
    again that the namespace had seen, why, and for a changed prompt where."""

    cached_tokens: int
    missed_tokens: int
    reason: str
    position: int | None = None
    part: str | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # Only when the request asked for it (`kvserve_cache_report: true`).
    kvserve_cache_report: CacheReportModel | None = Field(default=None, exclude_if=lambda v: v is None)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] | None = None
    # A reasoning model's think block, under vLLM's older and newer names; left out of a reply without
    # one: clients send the message back as it came, and SMG's router refuses a message that names both
    # (it reads them as one field given twice).
    reasoning_content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    reasoning: str | None = Field(default=None, exclude_if=lambda v: v is None)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]
    refusal: None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token (the first prompt token of an
    echo has no logprob)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
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
    # OpenAI sends only the keys that changed: role in the first chunk, then content or tool_calls.
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
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
    logprobs: CompletionLogprobs | None = None
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
