"""Llama 3.1 / 3.2 JSON calls: `{"name": "NAME", "parameters": ARGS}`, several separated by `; `; a model
may write `<|python_tag|>` first, and some write "arguments" for "parameters" (both parsed). Results
come back in `ipython` turns, which the template renders from `tool` messages."""

from kvserve.server.core.tool_formats.base import ToolFormat
from kvserve.server.core.tool_formats.layout import CallLayout

LLAMA3_JSON = ToolFormat(
    "llama3_json",
    CallLayout(key="parameters", sep="; ", other_keys=("arguments",), aliases=("<|python_tag|>",)),
    markers=("<|python_tag|>", "ipython"),
)
