"""Phi-4-mini: the calls as one JSON list inside `<|tool_call|>...<|/tool_call|>`; its template reads the
tools as JSON text on the system message (`<|tool|>...<|/tool|>`)."""

from kvserve.server.core.tool_formats.base import ToolFormat
from kvserve.server.core.tool_formats.layout import CallLayout

PHI4 = ToolFormat(
    "phi4",
    CallLayout(open="<|tool_call|>[", sep=", ", close="]<|/tool_call|>"),
    markers=("<|tool_call|>", "<|tool|>"),
    tools_in_system=True,
)
