"""Each API's max_tokens rule, as the neutral request applies it to a prompt's room in the context
(server/core/request.py:ChatRequest.max_tokens; each API's convert.py picks its rule): chat and
completions keep what was asked (the engine refuses it over the context), Responses fills the room left,
Messages is clamped to it, at least 1."""

from hypothesis import given
from hypothesis import strategies as st

from kvserve.engine.sampling_params import SamplingParams
from kvserve.server.core.request import ChatRequest, OverContext

MAX_MODEL_LEN = 4096


def _request(max_tokens: int | None, rule: OverContext) -> ChatRequest:
    return ChatRequest((), SamplingParams(max_tokens=max_tokens), over_context=rule)


@given(
    asked=st.none() | st.integers(0, 10 * MAX_MODEL_LEN),
    prompt=st.integers(1, MAX_MODEL_LEN),
    rule=st.sampled_from(OverContext),
)
def test_within_the_room_every_rule_keeps_what_was_asked(
    asked: int | None, prompt: int, rule: OverContext
) -> None:
    effective = _request(asked, rule).max_tokens(prompt, MAX_MODEL_LEN)
    room = MAX_MODEL_LEN - prompt
    if asked is None or asked <= room:
        assert effective == asked
    elif rule is OverContext.REFUSE:
        # Kept, for the engine's check to refuse with its message.
        assert effective == asked
    elif rule is OverContext.FILL:
        assert effective is None
    else:
        assert effective == max(1, room)


def test_the_rules_apart_on_one_prompt() -> None:
    prompt, asked = MAX_MODEL_LEN - 10, 100
    assert _request(asked, OverContext.REFUSE).max_tokens(prompt, MAX_MODEL_LEN) == 100
    assert _request(asked, OverContext.FILL).max_tokens(prompt, MAX_MODEL_LEN) is None
    assert _request(asked, OverContext.CLAMP).max_tokens(prompt, MAX_MODEL_LEN) == 10
    # A prompt that fills the context keeps 1, and the engine refuses it for its length.
    assert _request(asked, OverContext.CLAMP).max_tokens(MAX_MODEL_LEN, MAX_MODEL_LEN) == 1
