"""The rules of OpenAI's cache fields as breakpoints (server/core/prompt_cache.py), without a model: a
conversation "renders" as one token per message, so a marker's offset is its message count."""

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvserve.errors import InvalidRequestError
from kvserve.server.core.messages import ChatMessage
from kvserve.server.core.prompt_cache import (
    MAX_WRITTEN_BREAKPOINTS,
    RETENTION_24H_S,
    TTL_S,
    CachePolicy,
    Marker,
    cache_breakpoints,
    cache_policy,
    chat_markers,
)

PROMPT = list(range(1000))


def _render(messages: Sequence[ChatMessage]) -> list[int]:
    # The empty user turn cache_breakpoints appends renders as a token the prompt does not have.
    return [*range(len(messages) - 1), -1]


def test_each_field_alone() -> None:
    assert cache_policy(None, None, None) == CachePolicy(None)
    assert cache_policy("in_memory", "conversation-7", None) == CachePolicy(None)
    assert cache_policy("24h", None, None).whole_prompt_ttl_s == RETENTION_24H_S
    assert cache_policy(None, None, {}).whole_prompt_ttl_s == TTL_S["30m"]
    assert cache_policy(None, None, {"mode": "explicit"}).whole_prompt_ttl_s is None
    assert cache_policy(None, None, {"mode": "explicit", "ttl": "12h"}).default_ttl_s == TTL_S["12h"]
    assert cache_policy(None, None, {"prewarm": True}).prewarm
    assert not cache_policy(None, None, {"prewarm": False}).prewarm


def test_24h_holds_the_whole_prompt_whatever_the_mode() -> None:
    assert cache_policy("24h", None, {"mode": "explicit"}).whole_prompt_ttl_s == RETENTION_24H_S
    assert cache_policy("24h", None, {"ttl": "30m"}).whole_prompt_ttl_s == RETENTION_24H_S


@pytest.mark.parametrize(
    ("retention", "key", "options", "param"),
    [
        ("forever", None, None, "prompt_cache_retention"),
        ("in-memory", None, None, "prompt_cache_retention"),
        (None, "k" * 1025, None, "prompt_cache_key"),
        (None, ["k"], None, "prompt_cache_key"),
        (None, None, [], "prompt_cache_options"),
        (None, None, {"mode": None}, "prompt_cache_options.mode"),
        (None, None, {"ttl": 1800}, "prompt_cache_options.ttl"),
        (None, None, {"prewarm": "yes"}, "prompt_cache_options.prewarm"),
    ],
)
def test_a_bad_field_is_refused_by_name(retention: object, key: object, options: object, param: str) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        cache_policy(retention, key, options)
    assert raised.value.param == param


@given(st.lists(st.booleans(), min_size=1, max_size=12), st.booleans())
def test_the_latest_markers_are_written_with_the_implicit_one(marks: list[bool], implicit: bool) -> None:
    policy = cache_policy(None, None, {"mode": "implicit" if implicit else "explicit"})
    part = {"type": "text", "text": "x", "prompt_cache_breakpoint": {"mode": "explicit"}}
    messages = [
        ChatMessage.model_validate({"role": "user", "content": [part] if marked else "x"}) for marked in marks
    ]
    markers = chat_markers(messages, policy)
    assert [len(m.messages) for m in markers] == [k + 1 for k, marked in enumerate(marks) if marked]
    written = cache_breakpoints(policy, markers, PROMPT, _render)
    latest = [len(m.messages) for m in markers][-(MAX_WRITTEN_BREAKPOINTS - implicit) :]
    assert [b.tokens for b in written] == latest + ([len(PROMPT)] if implicit else [])
    assert len(written) <= MAX_WRITTEN_BREAKPOINTS


def test_a_marker_the_template_cannot_render_keeps_nothing() -> None:
    def refuse(messages: Sequence[ChatMessage]) -> list[int]:
        raise InvalidRequestError("no", "messages")

    marker = Marker((ChatMessage(role="user", content="x"),), 60.0)
    assert cache_breakpoints(CachePolicy(None), [marker], PROMPT, refuse) == ()
