"""The neutral conversation every API converts its request to: messages, their parts and tool calls.

No API owns these: OpenAI's chat messages have this shape (server/openai/protocol.py takes them as
they are), and Anthropic's and the Responses API's requests are converted to them
(server/anthropic/convert.py, server/responses/convert.py). The chat path (server/core/prompts.py,
server/core/tools.py) renders them.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Field limits of the protocols; each is far above what a real client sends.
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 256
MAX_STOP_CHARS = 512

StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class RequestModel(BaseModel):
    """A request body's base: fields it does not know are ignored, so that any client works unchanged."""

    model_config = ConfigDict(extra="ignore")


class ContentPart(RequestModel):
    """A part of a message's content; only `text` parts are supported, the others are refused by name."""

    type: str
    text: str | None = None
    # OpenAI's breakpoint marker, checked by server/core/prompt_cache.py.
    prompt_cache_breakpoint: Any = None


class FunctionCall(RequestModel):
    name: str
    # A JSON text, as OpenAI sends it.
    arguments: str


class ToolCall(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "user", "assistant", "tool"]
    # Null only in an assistant message that carries tool_calls.
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    tool_call_id: str | None = None
    # An assistant message's reasoning as this server returned it (vLLM's two names for it), passed to
    # a template that renders it.
    reasoning_content: str | None = None
    reasoning: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        # Joined as vLLM joins them, so that both servers see the same prompt tokens.
        return "\n".join(part.text or "" for part in self.content)
