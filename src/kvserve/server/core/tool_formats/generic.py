"""The generic format, for templates that know no tools: tools listed in the system prompt, one call
per line as `<tool_call>{"name": "NAME", "arguments": ARGS}</tool_call>`, results as user turns of
`<tool_response>` lines (server/core/tools.py renders them)."""

from kvserve.server.core.tool_formats.base import ToolFormat
from kvserve.server.core.tool_formats.layout import CallLayout

GENERIC = ToolFormat(
    "generic", CallLayout(call_open="<tool_call>", call_close="</tool_call>", sep="\n"), in_template=False
)
