"""Hermes / Qwen2.5 / Qwen3: each call a `<tool_call>` block of JSON on its own lines,
`<tool_call>\n{"name": "NAME", "arguments": ARGS}\n</tool_call>`; the template lists the tools in the
system turn inside `<tools></tools>` and renders results as `<tool_response>` in user turns."""

from kvserve.server.core.tool_formats.base import ToolFormat
from kvserve.server.core.tool_formats.layout import CallLayout

HERMES = ToolFormat(
    "hermes",
    CallLayout(call_open="<tool_call>\n", call_close="\n</tool_call>", sep="\n"),
    markers=("<tool_call>",),
)
