"""The harmony parser (server/core/harmony.py) on replies as gpt-oss writes them: analysis as reasoning,
commentary to functions.NAME as a call, final (and a commentary preamble) as content; streamed in any
pieces it gives what the whole reply gives; any text is parsed without raising."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.server.core import harmony
from kvserve.server.core.tool_formats.layout import ParsedCall

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather. Call the tool.<|end|>"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris"}'
)
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."
NAMES = frozenset({"get_weather"})


def test_analysis_then_a_call() -> None:
    reply = harmony.reply(ANALYSIS + CALL, NAMES)
    assert reply.reasoning == "The user wants the weather. Call the tool."
    assert reply.content is None
    assert reply.calls == [ParsedCall("get_weather", '{"city": "Paris"}')]


def test_analysis_then_a_final_answer() -> None:
    reply = harmony.reply(ANALYSIS + FINAL + "<|return|>", NAMES)
    assert reply.reasoning == "The user wants the weather. Call the tool."
    assert reply.content == "It is sunny in Paris."
    assert reply.calls == []


def test_a_call_in_the_templates_header_order_and_a_preamble() -> None:
    text = (
        "<|channel|>commentary<|message|>Checking.<|end|>"
        "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city": "Rome"}<|call|>'
    )
    reply = harmony.reply(text, NAMES)
    assert reply.content == "Checking."
    assert reply.calls == [ParsedCall("get_weather", '{"city": "Rome"}')]


@pytest.mark.parametrize(
    "call",
    [
        '<|channel|>commentary to=functions.other <|constrain|>json<|message|>{"city": "Paris"}',
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{not json",
        '<|channel|>commentary to=browser.search<|message|>{"q": 1}',
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"a": 1} trailing',
    ],
)
def test_what_is_not_a_call_of_the_tools_is_not_one(call: str) -> None:
    assert harmony.reply(ANALYSIS + "<|start|>assistant" + call, NAMES).calls == []


def test_a_reply_without_markup_is_content() -> None:
    assert harmony.reply("Just text.", NAMES) == harmony.Reply(None, "Just text.", [])


def test_a_reply_cut_short_inside_the_analysis_is_reasoning_so_far() -> None:
    reply = harmony.reply("<|channel|>analysis<|message|>Thinking about", NAMES)
    assert reply.reasoning == "Thinking about" and reply.calls == []


@settings(max_examples=200, deadline=None)
@given(
    text=st.sampled_from(
        [ANALYSIS + CALL, ANALYSIS + FINAL, FINAL[len("<|start|>assistant") :], "plain <| text"]
    ),
    cuts=st.lists(st.integers(0, 400), max_size=12),
)
def test_streamed_in_any_pieces_the_reply_is_the_whole_replys(text: str, cuts: list[int]) -> None:
    stream = harmony.HarmonyStream(NAMES)
    reasoning, content, calls = "", "", []
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    for i, piece in enumerate(pieces):
        delta = stream.push(piece, finished=i == len(pieces) - 1)
        reasoning += delta.get("reasoning_content", "")
        content += delta.get("content", "")
        calls += [(c["function"]["name"], c["function"]["arguments"]) for c in delta.get("tool_calls", [])]
    whole = harmony.reply(text, NAMES)
    assert reasoning == (whole.reasoning or "")
    assert content == (whole.content or "")
    assert calls == [(c.name, c.arguments) for c in whole.calls]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from([*harmony.MARKUP, "analysis", "final", "commentary", " to=functions.f", "{}", "x"])
    )
)
def test_any_text_parses_without_raising(parts: list[str]) -> None:
    text = "".join(parts)
    harmony.reply(text, frozenset({"f"}))
    harmony.reply(text, None, final=False)
    harmony.HarmonyStream().push(text, finished=True)


def test_the_constraint_names_every_tool_and_its_schema() -> None:
    grammar = harmony.constraint([("get_weather", {"type": "object"})], "required").grammar
    assert grammar is not None
    assert "commentary to=functions.get_weather " in grammar and "| final" not in grammar
    auto = harmony.constraint([("get_weather", {"type": "object"})], "auto").grammar
    assert auto is not None and "| final" in auto
    assert json.loads(grammar.split("%json ", 1)[1].splitlines()[0])["type"] == "object"


def test_a_template_is_harmony_by_its_markup() -> None:
    assert harmony.is_harmony("<|start|>{{ role }}<|channel|>final<|message|>")
    assert not harmony.is_harmony("<|im_start|>assistant")
    assert not harmony.is_harmony(None)
