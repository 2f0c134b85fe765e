"""What the server needs of a tool-call format's text (`CallSyntax`): writing calls back into a prompt,
parsing a reply whole and streamed, and the grammar that constrains a reply to calls. JSON formats
implement it once over their `CallLayout` (layout.py); formats of another shape (Qwen3.5's XML,
qwen3_xml.py) implement it themselves."""

from collections.abc import Collection, Sequence
from typing import Any, Protocol

from kvserve.server.core.tool_formats.layout import ParsedCall

# A tool as the grammar and the parsers see it: its name and its `parameters` JSON schema.
ToolSchema = tuple[str, dict[str, Any]]


class CallStreamer(Protocol):
    """One choice's text deltas as OpenAI's chunk deltas (`content`, or `tool_calls` entries: the id
    and name with empty arguments first, then argument pieces)."""

    num_calls: int

    def push(self, delta: str) -> dict[str, Any]: ...

    def finish(self) -> str:
        """The content held back until the reply ended (a text that might still have become a call)."""
        ...


class CallSyntax(Protocol):
    def bind(self, tools: Sequence[ToolSchema]) -> "CallSyntax":
        """This syntax for one request's tools (a format whose parsing reads the schemas keeps them)."""
        ...

    def markup(self) -> tuple[str, ...]:
        """The literal pieces of the markup (a tokenizer may hold some as special tokens)."""
        ...

    def calls_text(self, calls: Sequence[ParsedCall]) -> str:
        """A reply made of these calls, exactly as the constrained model writes them."""
        ...

    def reply_text(self, content: str, calls: Sequence[ParsedCall]) -> str:
        """An assistant message's text: its content and its calls as the model wrote them."""
        ...

    def is_call_text(self, text: str) -> bool:
        """Whether a reply is (or has started) calling."""
        ...

    def parse_calls(self, text: str, names: Collection[str] | None = None) -> list[ParsedCall] | None:
        """The calls of a reply that ends in calls; None for anything else, or when a call names a
        function that is not among `names`."""
        ...

    def lead(self, text: str) -> str | None:
        """The text a reply of calls writes before them (its content), None when there is none."""
        ...

    def complete_calls(self, text: str) -> list[ParsedCall]:
        """The calls a reply cut short completed before it ended."""
        ...

    def stream(self) -> CallStreamer: ...

    def text_rule(self) -> str:
        """The grammar's TEXT token: a reply that is not calls."""
        ...

    def calls_grammar(self, tools: Sequence[ToolSchema], parallel: bool, auto: bool) -> tuple[str, list[str]]:
        """The start rule's body for calls of `tools` (or, with `auto`, TEXT) and the rules it uses."""
        ...
