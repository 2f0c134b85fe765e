"""Chat encoding with remembered replies: their exact ids go into their own assistant message only."""

import pytest

from kvserve.model.loader import load_default_tokenizer
from kvserve.model.tokenizer import MessageDict, Tokenizer

REPLY = "Hello there, how are you?"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_default_tokenizer()


def _reply_ids(tok: Tokenizer) -> list[int]:
    # Ids that decode to the reply but are not how the text tokenizes: one token per character.
    ids = [tok.encode(c, add_special_tokens=False)[0] for c in REPLY]
    assert tok.decode(ids) == REPLY and ids != tok.encode(REPLY, add_special_tokens=False)
    return ids


def test_reply_quoted_in_an_earlier_user_message_is_spliced_into_the_assistant_message(
    tok: Tokenizer,
) -> None:
    """Regression: the reply's text also appears in the user message before it."""
    reply = _reply_ids(tok)
    messages: list[MessageDict] = [
        {"role": "user", "content": f"Please say exactly: {REPLY}"},
        {"role": "assistant", "content": REPLY},
        {"role": "user", "content": "Thanks!"},
    ]
    ids = tok.encode_chat(messages, known_reply=lambda text: reply if text == REPLY else None)
    text = tok.render_chat(messages)
    at = text.index(REPLY, text.index(REPLY) + 1)
    expected = (
        tok.encode(text[:at], add_special_tokens=False)
        + reply
        + tok.encode(text[at + len(REPLY) :], add_special_tokens=False)
    )
    assert ids == expected
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_only_assistant_messages_are_spliced_and_text_is_unchanged(tok: Tokenizer) -> None:
    reply = _reply_ids(tok)
    messages: list[MessageDict] = [
        {"role": "user", "content": REPLY},
        {"role": "assistant", "content": "Fine."},
        {"role": "user", "content": REPLY},
    ]
    ids = tok.encode_chat(messages, known_reply=lambda text: reply if text == REPLY else None)
    assert ids == tok.encode_chat(messages)


def test_several_replies_each_at_their_own_message(tok: Tokenizer) -> None:
    first, second = "One.", "Two, and more."
    known = {first: [tok.encode(c, add_special_tokens=False)[0] for c in first], second: None}
    messages: list[MessageDict] = [
        {"role": "user", "content": "Count."},
        {"role": "assistant", "content": first},
        {"role": "user", "content": f"{first} Go on."},
        {"role": "assistant", "content": second},
        {"role": "user", "content": "Again."},
    ]
    ids = tok.encode_chat(messages, known_reply=known.get)
    assert tok.decode(ids, skip_special_tokens=False) == tok.render_chat(messages)
    text = tok.render_chat(messages)
    at = text.index(first)
    head = tok.encode(text[:at], add_special_tokens=False)
    assert ids[: len(head) + len(first)] == head + known[first]  # type: ignore[operator]
