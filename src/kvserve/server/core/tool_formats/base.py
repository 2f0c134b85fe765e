"""The interface every tool-call format implements: a `ToolFormat` names its call syntax, the markers
that identify its chat templates, and how its tools reach the template."""

from dataclasses import dataclass
from typing import Generic, TypeVar

from kvserve.server.core.tool_formats.syntax import CallSyntax

Syntax = TypeVar("Syntax", bound=CallSyntax)


@dataclass(frozen=True)
class ToolFormat(Generic[Syntax]):
    """One family's way of calling tools.

    `in_template`: the chat template renders the tools (passed as its `tools` variable), the calls
    (as the assistant's text, written with `layout`) and the results (`tool` messages); otherwise the
    generic format puts all three in the messages' text. `markers`: text in a template's source that
    marks it as this format's (the first format with a marker in the source wins). `tools_in_system`:
    the template reads the tools as a JSON text on the system message (`tools` key), as Phi-4-mini's
    does, besides its `tools` variable."""

    name: str
    layout: Syntax
    markers: tuple[str, ...] = ()
    in_template: bool = True
    tools_in_system: bool = False
