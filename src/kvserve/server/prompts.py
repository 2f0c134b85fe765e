"""From what a client sends to prompt token ids: chats (with their tools), texts and batches.

The request plans (server/plan.py), /tokenize and pins build prompts here, behind the guard of what only
the server can check: a text's characters, before it is rendered or tokenized. Everything that needs the
tokens (their count, their range) is the engine's check (engine/validation.py).
"""

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.engine.async_engine import AsyncEngine
from kvserve.errors import InvalidRequestError
from kvserve.model.tokenizer import Tokenizer
from kvserve.server.protocol import ChatMessage
from kvserve.server.tools import ToolUse, conversation


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


def chat_prompt(
    async_engine: AsyncEngine,
    guard: PromptGuard,
    messages: Sequence[ChatMessage],
    namespace: str,
    add_generation_prompt: bool = True,
    tools: ToolUse | None = None,
) -> list[int]:
    """Token ids of a conversation (with its tools, calls and results in the generic format of
    server/tools.py); earlier replies of this engine come back as their exact ids, so the next turn of
    a chat finds its whole history in the prefix cache.

    The guard reads the turns as rendered, so every text the request carries counts before anything is
    tokenized: contents and their parts, calls' arguments and tool results (param `messages`), then the
    tools' names, descriptions and schemas (param `tools`)."""
    guard.check([turn["content"] for turn in conversation(messages, None)], "messages")
    turns = conversation(messages, tools)
    if tools is not None:
        guard.check([turn["content"] for turn in turns], "tools")
    return async_engine.encode_chat(turns, namespace, add_generation_prompt)


def text_prompt(tokenizer: Tokenizer, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
    return tokenizer.encode(prompt, add_special_tokens) if isinstance(prompt, str) else list(prompt)


CompletionPrompt = str | list[int] | list[str] | list[list[int]]


def prompt_batch(prompt: CompletionPrompt) -> list[str | list[int]]:
    """A completions `prompt` as a batch: one text or token-id list, or a batch of either."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) or not prompt:
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]
