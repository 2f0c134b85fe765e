"""A reasoning reply comes back split (think block as reasoning_content, the rest as content); its
exact ids still go back in, think block included, where the template renders the block again right
before the content, and only the content's text where the template drops the block.

Regression: the reply memory knew a reply only by its whole text, so a reasoning reply sent back
without its think block was re-tokenized, and in a tool loop (Qwen3's template keeps the block after
the last user query) turn 2 could miss turn 1's KV wherever BPE gives other ids than the generated ones.
"""

import pytest

from kvserve.engine.chat import encode_chat
from kvserve.engine.reply_memory import ReplyMemory, entry_bytes
from kvserve.model.loader import load_default_tokenizer
from kvserve.model.tokenizer import KnownReply, MessageDict, TemplateArgs, Tokenizer
from tests.server.chat_templates import QWEN3

REASONING = "The user greets me."
CONTENT = "Hello there, how are you?"
WHOLE = f"<think>\n{REASONING}\n</think>\n\n{CONTENT}"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_default_tokenizer()


def _odd_ids(tok: Tokenizer, text: str) -> list[int]:
    """Ids that decode to `text` but are not how it tokenizes: one token per character."""
    ids = [tok.encode(c, add_special_tokens=False)[0] for c in text]
    assert tok.decode(ids) == text and ids != tok.encode(text, add_special_tokens=False)
    return ids


def test_a_part_finds_the_whole_reply_with_its_lead() -> None:
    memory = ReplyMemory()
    memory.remember("a", WHOLE, [1, 2, 3])
    memory.remember_part("a", CONTENT, WHOLE)
    assert memory.lookup_reply("a", CONTENT) == KnownReply((1, 2, 3), WHOLE[: -len(CONTENT)])
    assert memory.lookup_reply("b", CONTENT) is None and memory.lookup("a", CONTENT) is None
    # A reply that is itself the text keeps its own entry.
    memory.remember("a", "Yes.", [7])
    memory.remember_part("a", "Yes.", "<think>x</think>Yes.")
    assert memory.lookup_reply("a", "Yes.") == KnownReply((7,))
    # A part whose whole reply is gone is no reply.
    small = ReplyMemory(capacity_bytes=entry_bytes("a", CONTENT, WHOLE) + entry_bytes("a", WHOLE, [1, 2, 3]))
    small.remember("a", WHOLE, [1, 2, 3])
    small.remember_part("a", CONTENT, WHOLE)
    small.remember("a", "other" * 10, [4])
    assert small.num_bytes <= small.capacity_bytes and small.lookup_reply("a", CONTENT) is None


def test_the_whole_reply_goes_back_where_the_template_renders_its_think_block(tok: Tokenizer) -> None:
    memory = ReplyMemory()
    whole_ids = _odd_ids(tok, WHOLE)
    memory.remember("a", WHOLE, whole_ids)
    memory.remember_part("a", CONTENT, WHOLE)
    args = TemplateArgs(QWEN3)
    # After the last user query (a tool loop), Qwen3's template renders the block again.
    kept: list[MessageDict] = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": CONTENT, "reasoning_content": REASONING},
        {"role": "tool", "content": "done"},
    ]
    ids = encode_chat(tok, memory, kept, "a", True, args)
    text = tok.render_chat(kept, True, args)
    at = text.index("<think>")
    assert (
        ids[: len(tok.encode(text[:at], False)) + len(whole_ids)] == tok.encode(text[:at], False) + whole_ids
    )
    assert tok.decode(ids, skip_special_tokens=False) == text
    # Before the last user query the template drops the block: the content is text like any other.
    dropped: list[MessageDict] = [*kept[:2], {"role": "user", "content": "And?"}]
    text = tok.render_chat(dropped, True, args)
    assert REASONING not in text
    assert encode_chat(tok, memory, dropped, "a", True, args) == tok.encode(text, add_special_tokens=False)
