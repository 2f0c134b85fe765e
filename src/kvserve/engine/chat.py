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
