"""From what a client sends to prompt token ids: chats (with their tools), texts, token ids and batches.

The chat routes, /tokenize and pins all build prompts here, behind the same guards: the prompt-length
guard before any text is rendered or tokenized, and token ids within the vocabulary before anything
reads them.
"""

from collections.abc import Sequence

from kvserve.model.tokenizer import Tokenizer
from kvserve.server.context import ServerContext
from kvserve.server.errors import APIError
from kvserve.server.formats import PromptInput
from kvserve.server.protocol import ChatMessage
from kvserve.server.tools import ToolUse, conversation


def chat_prompt(
    ctx: ServerContext,
    messages: list[ChatMessage],
    namespace: str,
    add_generation_prompt: bool = True,
    tools: ToolUse | None = None,
) -> list[int]:
    """Token ids of a conversation (with its tools, calls and results in the generic format of
    server/tools.py); earlier replies of this engine come back as their exact ids, so the next turn of
    a chat finds its whole history in the prefix cache."""
    ctx.prompt_guard.check([m.text for m in messages], "messages")
    return ctx.async_engine.encode_chat(conversation(messages, tools), namespace, add_generation_prompt)


def text_prompt(tokenizer: Tokenizer, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
    return tokenizer.encode(prompt, add_special_tokens) if isinstance(prompt, str) else list(prompt)


def check_token_ids(vocab: int, batch: Sequence[str | Sequence[int]], param: str = "prompt") -> None:
    """Token ids a client sends must be in [0, vocab) before anything reads them: the tokenizer cannot
    decode, nor a cache key pack, what is out of range."""
    if any(not isinstance(p, str) and any(not 0 <= t < vocab for t in p) for p in batch):
        raise APIError(400, f"Prompt token ids must be in [0, {vocab}).", param=param)


CompletionPrompt = str | list[int] | list[str] | list[list[int]]


def prompt_batch(prompt: CompletionPrompt) -> list[str | list[int]]:
    """A completions `prompt` as a batch: one text or token-id list, or a batch of either."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) or not prompt:
        return [prompt]  # type: ignore[list-item]
    return list(prompt)  # type: ignore[arg-type]


def completion_prompts(tokenizer: Tokenizer, prompt: CompletionPrompt) -> list[PromptInput]:
    """Each prompt of a completions `prompt` with its echo text."""
    batch = prompt_batch(prompt)
    # Checked before the echo text is decoded from them.
    check_token_ids(tokenizer.vocab_size, batch)
    return [
        PromptInput(text_prompt(tokenizer, p), p if isinstance(p, str) else tokenizer.decode(p, False))
        for p in batch
    ]
