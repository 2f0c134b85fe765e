"""Request and response bodies of OpenAI's Responses API (`POST /v1/responses`), as pydantic models.

As in server/core/messages.py, requests ignore fields they do not know, and fields that change nothing here
(`include`, `reasoning.effort`, `reasoning.summary`, `reasoning.context`, `text.verbosity`,
`client_metadata`, `user`, `service_tier`, `truncation`) are parsed and left
without effect (docs/api.md, *Responses API*). Input items are one permissive model: which fields
an item needs depends on its `type`, and server/responses/convert.py checks them, naming the item.
Responses carry OpenAI's field names, the ones always null here included, because clients index them.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from kvserve.server.core.messages import MAX_CONTENT_PARTS, MAX_MESSAGES, RequestModel

# A call id or a response id a client sends back: far longer than any this server makes.
MAX_ID_CHARS = 256
# OpenAI's bounds on `metadata`.
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_TOOL_ENTRIES = 256

Id = Annotated[str, Field(max_length=MAX_ID_CHARS)]


class InputPart(RequestModel):
    """A part of an item's content: `input_text`, `output_text` (and a reasoning item's `reasoning_text`
    and `summary_text`) are read; any other type is refused by name."""

    type: str
    text: str | None = None
    # OpenAI's breakpoint marker, checked by server/core/prompt_cache.py.
    prompt_cache_breakpoint: Any = None


Parts = Annotated[list[InputPart], Field(max_length=MAX_CONTENT_PARTS)]


class InputItem(RequestModel):
    """One item of `input`: a message (`type` "message", or absent with a `role`), a `function_call`, a
    `function_call_output`, a `custom_tool_call` (its free text in `input`), a `custom_tool_call_output`,
    a `reasoning` item or an `additional_tools` item (its `tools` join the request's)."""

    type: str | None = None
    id: Id | None = None
    role: str | None = None
    content: str | Parts | None = None
    call_id: Id | None = None
    name: str | None = None
    arguments: str | None = None
    input: str | None = None
    tools: Annotated[list[Any], Field(max_length=MAX_TOOL_ENTRIES)] | None = None
    output: str | Parts | None = None
    summary: Parts | None = None
    encrypted_content: str | None = None
    status: str | None = None


class TextFormat(RequestModel):
    type: str = "text"
    name: str | None = None
    # `schema` shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(RequestModel):
    effort: str | None = None
    summary: str | None = None
    context: str | None = None


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)]
    instructions: str | None = None
    # Checked by server/responses/convert.py: function tools are served, namespaces flattened, hosted
    # tools dropped.
    tools: Annotated[list[Any], Field(max_length=MAX_TOOL_ENTRIES)] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    store: bool = True
    previous_response_id: Id | None = None
    stream: bool = False
    # Accepted without effect.
    include: Annotated[list[str], Field(max_length=64)] | None = None
    reasoning: ReasoningConfig | None = None
    # Checked by server/core/prompt_cache.py.
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    metadata: dict[str, str] | None = None
    client_metadata: dict[str, Any] | None = None
    user: str | None = None


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: str = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    # The exact text the model generated for the arguments.
    arguments: str
    status: str = "completed"


class CustomToolCallItem(BaseModel):
    type: Literal["custom_tool_call"] = "custom_tool_call"
    id: str
    call_id: str
    name: str
    # The free text: the string the model generated as the call's one argument.
    input: str
    status: str = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]
    encrypted_content: None = None
    status: str = "completed"


OutputItem = OutputMessage | FunctionCallItem | CustomToolCallItem | ReasoningItem


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: str
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[Any] = Field(default_factory=list)
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    # Only when the request named `prompt_cache_options.comparison_response_id` (serving.py).
    prompt_cache_diagnostics: dict[str, Any] | None = Field(default=None, exclude_if=lambda v: v is None)


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool = False
