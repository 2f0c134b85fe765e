"""Tool-call formats, one module each, behind one interface (`ToolFormat`, base.py) and this registry.

`choose` picks a template's format: the one named by `--tool-call-format`, or, on `auto`, the first
format whose markers the template's source holds once the template is seen to render tools; a template
that renders no tools (or none of the known calls) gets the generic format. Adding a format is one
module with its layout and markers, and one line here.
"""

from typing import Any

from kvserve.server.core.tool_formats.base import ToolFormat
from kvserve.server.core.tool_formats.generic import GENERIC
from kvserve.server.core.tool_formats.hermes import HERMES
from kvserve.server.core.tool_formats.llama3_json import LLAMA3_JSON
from kvserve.server.core.tool_formats.mistral import MISTRAL
from kvserve.server.core.tool_formats.phi4 import PHI4
from kvserve.server.core.tool_formats.qwen3_xml import QWEN3_XML

__all__ = ["AUTO", "CHOICES", "FORMATS", "GENERIC", "ToolFormat", "choose"]

# In the order auto tries them: Qwen3.5's XML before Hermes, whose `<tool_call>` its templates also
# hold; Llama's last, since "ipython" is the least specific marker.
FORMATS: dict[str, ToolFormat[Any]] = {
    f.name: f for f in (GENERIC, PHI4, MISTRAL, QWEN3_XML, HERMES, LLAMA3_JSON)
}
AUTO = "auto"
CHOICES = (AUTO, *FORMATS)


def choose(name: str, source: str | None, renders_tools: bool) -> ToolFormat[Any]:
    """The format `name` asks for, or on "auto" the one the template's `source` is written for."""
    if name != AUTO:
        return FORMATS[name]
    if source is None or not renders_tools:
        return GENERIC
    for fmt in FORMATS.values():
        if any(marker in source for marker in fmt.markers):
            return fmt
    return GENERIC
