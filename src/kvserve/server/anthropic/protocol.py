"""Request and response bodies of Anthropic's Messages API (`POST /v1/messages`), as pydantic models.

Requests ignore fields they do not know, as the OpenAI models do. Content blocks are one model with the
fields of every block type, so that a block of a type kvserve does not read (image, document, ...) is
parsed and then refused by name (server/anthropic/convert.py) rather than failing a union with a
message about every member. A tool result's content is a string or a list of blocks that hold no
further content: the nesting ends there. The fields that change nothing here (`metadata`,
`context_management`, `service_tier`, `output_config.effort`, a thinking budget) are parsed and
ignored; docs/api.md lists them.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.server.core.messages import MAX_CONTENT_PARTS, MAX_MESSAGES, StopString

# Anthropic accepts at most this many stop sequences; SamplingParams bounds them too.
MAX_STOP_SEQUENCES = 16
# Anthropic's own bound on max_tokens is far below this; past it a value is a mistake, not a wish.
MAX_MAX_TOKENS = 1_000_000


class AnthropicRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CacheControl(AnthropicRequest):
    """A cache breakpoint: `ephemeral`, for 5 minutes (the default) or `"1h"`."""

    type: str
    ttl: str | None = None


class InnerBlock(AnthropicRequest):
    """A block inside a tool result's content: text is read, any other type is refused by name."""

    type: str
    text: str | None = None
    cache_control: CacheControl | None = None


class Block(AnthropicRequest):
    """A content block of any type; which fields a type needs is checked where it is read."""

    type: str
    text: str | None = None
    cache_control: CacheControl | None = None
    # tool_use
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    # tool_result
    tool_use_id: str | None = None
    content: str | Annotated[list[InnerBlock], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    is_error: bool | None = None
    # thinking (the signature is Anthropic's proof of its own thinking; here it is not checked)
    thinking: str | None = None
    signature: str | None = None


Content = str | Annotated[list[Block], Field(max_length=MAX_CONTENT_PARTS)]


class AnthropicMessage(AnthropicRequest):
    # Anthropic's turns are user and assistant; a system turn inside `messages` is read too (Claude
    # Code sends one).
    role: Literal["user", "assistant", "system"]
    content: Content


class MessagesBase(AnthropicRequest):
    """What a message request and a token count share: everything that makes the prompt."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Content | None = None
    tools: Annotated[list[Any], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    # The top-level breakpoint: the last cacheable block of the request.
    cache_control: CacheControl | None = None


class DiagnosticsRequest(BaseModel):
    """Anthropic's cache diagnosis (beta `cache-diagnosis-2026-04-07`): the message to compare with,
    None on a first turn (the request opts in)."""

    previous_message_id: str | None = None


class MessagesRequest(MessagesBase):
    max_tokens: int
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    # Accepted without effect (docs/api.md, *Anthropic Messages API*).
    metadata: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    service_tier: str | None = None
    diagnostics: DiagnosticsRequest | None = None


class CountTokensRequest(MessagesBase):
    pass


class AnthropicUsage(BaseModel):
    """The prompt in three parts that add up to it: not cached (`input_tokens`), read from the cache,
    and newly cached up to the request's last breakpoint."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    # cache_creation_input_tokens by the TTL of the breakpoint that keeps them.
    cache_creation: dict[str, int] = Field(
        default_factory=lambda: {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}
    )


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: AnthropicUsage
    # Only when the request sent `diagnostics` (serving.py's `diagnosis`).
    diagnostics: dict[str, Any] | None = Field(default=None, exclude_if=lambda v: v is None)


class TokenCount(BaseModel):
    input_tokens: int
