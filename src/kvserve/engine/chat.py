"""Chat encoding with the reply splice: the one way a conversation becomes prompt token ids.

The chat template renders the messages, and each assistant message that repeats a reply the engine
generated in the same namespace comes back as the exact ids it was generated as (engine/reply_memory.py),
so the next turn of a chat finds its whole history in the prefix cache. The server (through
`AsyncEngine.encode_chat`) and `LLM` both call it. It reads only the tokenizer and the thread-safe reply
memory, so any thread may, and a long chat should be encoded off the event loop.
"""

from collections.abc import Sequence

from jinja2 import TemplateError

from kvserve.engine.reply_memory import ReplyMemory
from kvserve.errors import InvalidRequestError
from kvserve.model.tokenizer import NO_TEMPLATE_ARGS, MessageDict, ReplyLookup, TemplateArgs, Tokenizer
from kvserve.sequences import common_prefix_len

# A reply's stand-in when the next turn is rendered to see how it renders the reply's turn: a NUL first,
# so that it shares no character with a generation prompt's text.
_PROBE = "\x00kvserve-probe"


def encode_chat(
    tokenizer: Tokenizer,
    replies: ReplyMemory,
    messages: Sequence[MessageDict],
    namespace: str = "",
    add_generation_prompt: bool = True,
    args: TemplateArgs = NO_TEMPLATE_ARGS,
    known_reply: ReplyLookup | None = None,
) -> list[int]:
    """Token ids of a conversation, earlier replies spliced in as their generated ids; a conversation
    the template cannot render is an InvalidRequestError on `messages`. `known_reply` replaces the
    reply memory's lookup (a stored conversation's own ids: server/responses/store.py).

    A template is a program run over the client's data (its messages, tools and template variables): a
    variable of an unexpected type makes a template raise TypeError or the like, which is the request's
    fault as much as a TemplateError is."""
    try:
        return tokenizer.encode_chat(
            messages,
            add_generation_prompt,
            known_reply=known_reply or (lambda text: replies.lookup_reply(namespace, text)),
            args=args,
        )
    except (ValueError, TemplateError, TypeError, AttributeError, LookupError, RecursionError) as e:
        raise InvalidRequestError(f"The chat template cannot render these messages: {e}", "messages") from e


def reply_turn_start(
    tokenizer: Tokenizer, messages: Sequence[MessageDict], args: TemplateArgs, token_ids: Sequence[int]
) -> int | None:
    """Where a chat prompt's generation prompt parts from the reply's turn as the next turn renders it:
    the end of the turn's header when the template drops the rest (Qwen's empty think block, or the
    think block of a reply before the last user message). A hybrid model keeps its state there, so the
    next turn resumes at the header's end, as an attention model would, and not at the last message
    end before it. None where the generation prompt is all shared (the prompt's end is kept anyway),
    where it is not the prompt's end, or where the tokens do not part there."""
    probe: list[MessageDict] = [
        *messages,
        {"role": "assistant", "content": _PROBE},
        {"role": "user", "content": _PROBE},
    ]
    try:
        prompt = tokenizer.render_chat(messages, True, args)
        history = tokenizer.render_chat(messages, False, args)
        after = tokenizer.render_chat(probe, False, args)
    except (ValueError, TemplateError, TypeError, AttributeError, LookupError, RecursionError):
        return None
    shared = common_prefix_len(prompt, after)
    if not prompt.startswith(history) or not len(history) <= shared < len(prompt):
        return None
    tail = tokenizer.encode(prompt[shared:], add_special_tokens=False)
    if not tail or len(tail) >= len(token_ids) or list(token_ids[len(token_ids) - len(tail) :]) != tail:
        return None
    return len(token_ids) - len(tail)
