"""From what a client sends to prompt token ids: chats (with their tools), texts and batches.

The request plans (server/core/plan.py), /tokenize and pins build prompts here, behind the guard of what only
the server can check: a text's characters, before it is rendered or tokenized. Everything that needs the
tokens (their count, their range) is the engine's check (engine/validation.py).
"""

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from kvserve.engine.async_engine import AsyncEngine
from kvserve.errors import InvalidRequestError
from kvserve.model.tokenizer import KnownReply, MessageDict, TemplateArgs, Tokenizer
from kvserve.server.core import harmony
from kvserve.server.core.chat_setup import ChatSetup
from kvserve.server.core.messages import ChatMessage
from kvserve.server.core.tool_formats.layout import ParsedCall
from kvserve.server.core.tools import ToolUse, conversation, template_tools

# chat_template_kwargs: template variables a client may set, within these bounds. The names the
# renderer itself passes (or that change how it renders, not what) are not the client's to replace.
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARGS_CHARS = 8192
_KWARG_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
        "raise_exception",
        "strftime_now",
    }
)


@dataclass(frozen=True)
class PromptGuard:
    """Refuses a prompt text that must be over the context before it is rendered or tokenized.

    No token is longer than `max_token_chars` characters, so a text of more than
    max_model_len * max_token_chars characters has more than max_model_len tokens, whatever they are.
    """

    max_model_len: int
    max_token_chars: int

    def check(self, texts: Sequence[str], param: str) -> None:
        chars = sum(len(t) for t in texts)
        if chars > self.max_model_len * self.max_token_chars:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens, and {chars} "
                f"characters are more tokens than that; shorten the {param}.",
                param,
            )
        for text in texts:
            if not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    raise InvalidRequestError(
                        "The text is not valid Unicode (it has a lone surrogate escape).", param
                    ) from None


def template_kwargs(raw: Mapping[str, Any] | None) -> dict[str, Any]:
    """A request's chat_template_kwargs, checked: at most MAX_TEMPLATE_KWARGS names, each an identifier
    that is not reserved (nor a special token's, `*_token`), all of it at most MAX_TEMPLATE_KWARGS_CHARS
    as JSON."""
    if not raw:
        return {}
    if len(raw) > MAX_TEMPLATE_KWARGS:
        raise InvalidRequestError(
            f"chat_template_kwargs may set at most {MAX_TEMPLATE_KWARGS} variables", "chat_template_kwargs"
        )
    for name in raw:
        if not _KWARG_NAME.fullmatch(name) or name in RESERVED_TEMPLATE_NAMES or name.endswith("_token"):
            raise InvalidRequestError(
                f"chat_template_kwargs cannot set {name[:64]!r}: a variable is a name of letters, digits "
                "and underscores, and the messages, tools, generation prompt and special tokens are the "
                "server's",
                "chat_template_kwargs",
            )
    try:
        size = len(json.dumps(raw))
    except (ValueError, RecursionError):
        size = MAX_TEMPLATE_KWARGS_CHARS + 1
    if size > MAX_TEMPLATE_KWARGS_CHARS:
        raise InvalidRequestError(
            f"chat_template_kwargs is over {MAX_TEMPLATE_KWARGS_CHARS} characters as JSON",
            "chat_template_kwargs",
        )
    return dict(raw)


# Efforts other APIs name that harmony's three stand for.
_EFFORT_ALIASES = {"minimal": "low", "xhigh": "high", "max": "high"}


def with_effort(kwargs: dict[str, Any], effort: str | None) -> dict[str, Any]:
    """A harmony chat's template variables with the API's reasoning effort as `reasoning_effort`
    (gpt-oss's template writes it into the system message: `Reasoning: low|medium|high`), unless they
    set it already; an effort harmony has not (after its aliases: minimal is low) is a 400."""
    if effort is None:
        return kwargs
    effort = _EFFORT_ALIASES.get(effort, effort)
    if effort not in harmony.EFFORTS:
        raise InvalidRequestError(
            f"reasoning_effort must be one of {', '.join(harmony.EFFORTS)}, not {effort!r}",
            "reasoning_effort",
        )
    return {"reasoning_effort": effort, **kwargs}


def chat_turns(
    guard: PromptGuard,
    messages: Sequence[ChatMessage],
    tools: ToolUse | None,
    setup: ChatSetup,
    kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[MessageDict], TemplateArgs]:
    """A conversation as the template takes it (turns and template args), behind the guard.

    The guard reads the turns as rendered, so every text the request carries counts before anything is
    tokenized: contents and their parts, calls' arguments, reasoning and tool results (param
    `messages`), then the tools' names, descriptions and schemas (param `tools`)."""
    if setup.harmony:
        turns = harmony_conversation(messages)
        guard.check([(t.get("content") or "") + t.get("thinking", "") for t in turns], "messages")
    else:
        plain = conversation(messages, None, setup.tools)
        guard.check([t.get("content", "") + t.get("reasoning_content", "") for t in plain], "messages")
        turns = conversation(messages, tools, setup.tools)
    listed = None
    if tools is not None:
        if setup.tools.in_template or setup.harmony:
            listed = template_tools(tools)
            guard.check([json.dumps(listed)], "tools")
        else:
            guard.check([turn["content"] for turn in turns], "tools")
    return turns, TemplateArgs(source=setup.template, tools=listed, kwargs=dict(kwargs or {}))


def chat_prompt(
    async_engine: AsyncEngine,
    guard: PromptGuard,
    messages: Sequence[ChatMessage],
    namespace: str,
    add_generation_prompt: bool = True,
    tools: ToolUse | None = None,
    setup: ChatSetup | None = None,
    kwargs: Mapping[str, Any] | None = None,
    reasoning_effort: str | None = None,
) -> list[int]:
    """Token ids of a conversation (with its tools, calls and results in the server's tool format,
    server/core/tools.py, and the template variables `kwargs`), behind the guard (`chat_turns`); earlier
    replies of this engine come back as their exact ids, so the next turn of a chat finds its whole
    history in the prefix cache."""
    setup = setup or ChatSetup()
    if setup.harmony:
        kwargs = with_effort(dict(kwargs or {}), reasoning_effort)
    turns, args = chat_turns(guard, messages, tools, setup, kwargs)
    if setup.harmony:
        return harmony_prompt(async_engine, turns, namespace, add_generation_prompt, args)
    return async_engine.encode_chat(turns, namespace, add_generation_prompt, args)


def reply_turn_start(
    async_engine: AsyncEngine,
    guard: PromptGuard,
    messages: Sequence[ChatMessage],
    tools: ToolUse | None,
    setup: ChatSetup,
    kwargs: Mapping[str, Any] | None,
    token_ids: Sequence[int],
) -> int | None:
    """A hybrid model's chat prompt `token_ids`: where its generation prompt parts from the reply's turn
    as the next turn renders it (`AsyncEngine.reply_turn_start`), the position to keep the state at so
    that the next turn resumes there; None on other models (they keep every token) and for harmony
    chats (their replies come back whole)."""
    if setup.harmony or not async_engine.keeps_states:
        return None
    turns, args = chat_turns(guard, messages, tools, setup, kwargs)
    return async_engine.reply_turn_start(turns, args, token_ids)


def harmony_conversation(messages: Sequence[ChatMessage]) -> list[MessageDict]:
    """The messages as gpt-oss's template takes them: an assistant turn's reasoning as `thinking` and
    its call with object arguments (server/core/harmony.py), tool results and the rest as they are."""
    out: list[MessageDict] = []
    for m in messages:
        if m.role == "assistant":
            reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            calls = [ParsedCall(c.function.name, c.function.arguments) for c in m.tool_calls or ()]
            out.append(harmony.harmony_turn("assistant", m.text, reasoning, calls))
        else:
            out.append({"role": m.role, "content": m.text})
    return out


def harmony_prompt(
    async_engine: AsyncEngine,
    turns: Sequence[MessageDict],
    namespace: str,
    add_generation_prompt: bool,
    args: TemplateArgs,
) -> list[int]:
    """A harmony conversation's ids: rendered by the template, earlier replies spliced back as the ids
    the model wrote, analysis included (`harmony.encode`)."""
    try:
        text = async_engine.tokenizer.render_chat(turns, add_generation_prompt, args)
    except (ValueError, TemplateError, TypeError, AttributeError, LookupError, RecursionError) as e:
        raise InvalidRequestError(f"The chat template cannot render these messages: {e}", "messages") from e

    def lookup(key: str) -> list[int] | None:
        known = async_engine.lookup_reply(namespace, key)
        return None if known is None else list(known.ids)

    return harmony.encode(async_engine.tokenizer, turns, text, lookup)


@dataclass(frozen=True)
class Continuation:
    """A stored conversation's exact token ids: its prompt and its reply's ids (`ids`), the reply's
    content as its assistant message renders it, and the text the ids stand for before that content
    (`lead`: the rendered prompt, then a think block the content follows)."""

    ids: tuple[int, ...]
    content: str
    lead: str

    def lookup(self, text: str) -> KnownReply | None:
        return KnownReply(self.ids, self.lead) if text == self.content else None


def continued_chat_prompt(
    async_engine: AsyncEngine,
    guard: PromptGuard,
    messages: Sequence[ChatMessage],
    namespace: str,
    tools: ToolUse | None,
    setup: ChatSetup,
    continuation: Continuation | None,
) -> tuple[list[int], str]:
    """A conversation's token ids and its rendered text, continuing `continuation` when it is given:
    its ids come first, exactly, and only the text the template renders after the reply is tokenized.
    Where the template renders the stored part otherwise (other instructions or tools, a dropped think
    block), the conversation is encoded as chat encodes it, the reply memory splicing what it knows."""
    turns, args = chat_turns(guard, messages, tools, setup)
    ids = None
    if continuation is not None:
        ids = async_engine.encode_chat(turns, namespace, True, args, continuation.lookup)
        if tuple(ids[: len(continuation.ids)]) != continuation.ids:
            ids = None
    if ids is None:
        ids = async_engine.encode_chat(turns, namespace, True, args)
    try:
        text = async_engine.tokenizer.render_chat(turns, True, args)
    except TemplateError as e:
        # The same rendering as the encoding's, but for its deadline (model/template_budget.py).
        raise InvalidRequestError(f"The chat template cannot render these messages: {e}", "messages") from e
    return ids, text


def text_prompt(tokenizer: Tokenizer, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
    return tokenizer.encode(prompt, add_special_tokens) if isinstance(prompt, str) else list(prompt)


CompletionPrompt = str | list[int] | list[str] | list[list[int]]


def prompt_batch(prompt: CompletionPrompt) -> list[str | list[int]]:
    """A completions `prompt` as a batch: one text or token-id list, or a batch of either."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) or not prompt:
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]
