"""How this server talks to its model in chat: the template, the tool-call format and the reasoning
parser, chosen once at startup from the options and the template itself (docs/api.md, *Tools*).

`--chat-template FILE` replaces the tokenizer's template. `--tool-call-format auto` renders a probe
conversation with one tool and, when the tool's name shows in the text, takes the format whose markers
the template's source holds (server/tool_formats); a template that renders no tools (or raises on the
probe, said in one log line) gets the generic format. A template that runs past its deadline on the
probe (model/template_budget.py) stops the server with one line: it would on every chat.
`--reasoning-parser auto` splits `<think>` blocks off replies when the template's source mentions
`<think>`. A template that writes harmony (gpt-oss's channels, server/core/harmony.py) makes the chat a
harmony chat: replies keep their markup and are parsed into reasoning, content and calls, whatever the
two options say.
"""

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError

from kvserve.errors import ConfigError
from kvserve.model.template_budget import TemplateBudgetError
from kvserve.model.tokenizer import TemplateArgs, Tokenizer
from kvserve.server.core.harmony import is_harmony
from kvserve.server.core.reasoning import THINK_OPEN
from kvserve.server.core.tool_formats import GENERIC, ToolFormat, choose

log = logging.getLogger("kvserve.server")

_PROBE_NAME = "kvserve_probe_tool_7f3a"
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": _PROBE_NAME, "description": "", "parameters": {"type": "object", "properties": {}}},
}


@dataclass(frozen=True)
class ChatSetup:
    """`template`: the source that replaces the tokenizer's (None: its own); `tools`: the format of
    tool calls; `reasoning`: whether replies' think blocks become `reasoning_content`;
    `keep_special_tokens`: the tokenizer holds some of the format's markup as special tokens (Mistral's
    `[TOOL_CALLS]`, Llama's `<|python_tag|>`), which a reply with tools must then keep in its text to be
    parsed."""

    template: str | None = None
    tools: ToolFormat[Any] = GENERIC
    reasoning: bool = False
    keep_special_tokens: bool = False
    # The template writes harmony (server/core/harmony.py): the replies' channels are their reasoning,
    # content and calls.
    harmony: bool = False

    def args(self) -> TemplateArgs:
        return TemplateArgs(source=self.template)


def renders_tools(tokenizer: Tokenizer, template: str | None) -> bool:
    """Whether the template writes the tools it is given into the prompt (as a variable, or as the
    system message's `tools` text, Phi-4-mini's way)."""
    messages = [
        {"role": "system", "content": "s", "tools": json.dumps([_PROBE_TOOL])},
        {"role": "user", "content": "u"},
    ]
    try:
        text = tokenizer.render_chat(messages, True, TemplateArgs(source=template, tools=[_PROBE_TOOL]))
    except TemplateBudgetError as e:
        raise ConfigError(f"the chat template cannot render a one-message chat: {e}") from None
    except (ValueError, TemplateError, TypeError, AttributeError, LookupError) as e:
        log.warning("chat: the template raises on a chat with tools (%s): tools get the generic format", e)
        return False
    return _PROBE_NAME in text


def read_chat_template(path: str | None) -> str | None:
    """The template file's text (`--chat-template`); a file that cannot be read stops the server."""
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--chat-template: cannot read {path}: {e}") from None


def chat_setup(
    tokenizer: Tokenizer, template: str | None, tool_call_format: str, reasoning_parser: str
) -> ChatSetup:
    source = template if template is not None else tokenizer.chat_template
    if is_harmony(source):
        log.info("chat: harmony format (channels for reasoning and tool calls)")
        return ChatSetup(template, GENERIC, reasoning=True, keep_special_tokens=True, harmony=True)
    has_template = source is not None
    tools = choose(tool_call_format, source, has_template and renders_tools(tokenizer, template))
    if reasoning_parser == "auto":
        reasoning = source is not None and THINK_OPEN in source
    else:
        reasoning = reasoning_parser == "think"
    log.info("chat: tool-call format %s, reasoning parser %s", tools.name, "think" if reasoning else "off")
    special = tokenizer.special_tokens
    keep = any(token in piece for piece in tools.layout.markup() for token in special)
    return ChatSetup(template, tools, reasoning, keep)
