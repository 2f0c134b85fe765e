"""Mistral: the calls as one JSON list after `[TOOL_CALLS]`,
`[TOOL_CALLS][{"name": "NAME", "arguments": ARGS}, ...]`; the template lists the tools in
`[AVAILABLE_TOOLS]` and renders results in `[TOOL_RESULTS]`."""

from kvserve.server.core.tool_formats.base import ToolFormat
from kvserve.server.core.tool_formats.layout import CallLayout

MISTRAL = ToolFormat(
    "mistral", CallLayout(open="[TOOL_CALLS][", sep=", ", close="]"), markers=("[TOOL_CALLS]",)
)
