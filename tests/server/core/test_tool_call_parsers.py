"""Every tool-call format's writer, parser and stream, and the reasoning splitter, without a model.

Each format's calls written as the constrained model writes them parse back to the same names and
exact argument texts, whole and streamed in any chunking; what real models write unconstrained (other
whitespace, Llama's <|python_tag|> and "arguments") parses too; hostile text (malformed JSON, unknown
names, unterminated markup, deep nesting) is no call, and no text makes a parser raise (hypothesis).
"""

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.options import TOOL_CALL_FORMATS
from kvserve.server.core.reasoning import ReasoningStream, closes_reasoning, opens_reasoning, split
from kvserve.server.core.tool_formats import CHOICES, FORMATS, ToolFormat, choose
from kvserve.server.core.tool_formats.layout import CallLayout, ParsedCall

ALL = list(FORMATS.values())
# The formats of JSON calls, one CallLayout each (Qwen3.5's XML has its own tests).
JSON = [f for f in ALL if isinstance(f.layout, CallLayout)]
ARGS = ['{"city":"Oslo}</tool_call>]"}', '{"zone":"UTC","n":[1,{"a":"<|/tool_call|>"}]}']
CALLS = [ParsedCall("get_weather", ARGS[0]), ParsedCall("get-time_2", ARGS[1])]


def _streamed(fmt: ToolFormat[Any], text: str, size: int) -> tuple[list[tuple[str, str]], str]:
    """The calls and the content a stream of `text` in pieces of `size` sends."""
    stream = fmt.layout.stream()
    got: dict[int, dict[str, str]] = {}
    content = ""
    for i in range(0, len(text), size):
        delta = stream.push(text[i : i + size])
        content += delta.get("content", "")
        for d in delta.get("tool_calls", []):
            entry = got.setdefault(d["index"], {"name": "", "arguments": ""})
            entry["name"] += d.get("function", {}).get("name", "")
            entry["arguments"] += d["function"]["arguments"]
    return [(g["name"], g["arguments"]) for g in got.values()], content + stream.finish()


def test_the_options_offer_the_registrys_formats() -> None:
    assert TOOL_CALL_FORMATS == CHOICES
    assert choose("mistral", None, False) is FORMATS["mistral"]
    assert choose("auto", "{{ tools }} <tool_call>", False) is FORMATS["generic"]


@pytest.mark.parametrize("fmt", JSON, ids=lambda f: f.name)
def test_written_calls_parse_back_exactly_whole_and_streamed(fmt: ToolFormat[Any]) -> None:
    text = fmt.layout.calls_text(CALLS)
    assert fmt.layout.parse_calls(text) == CALLS
    assert fmt.layout.parse_calls(text + "\n") == CALLS
    single = fmt.layout.calls_text(CALLS[:1])
    assert fmt.layout.parse_calls(single) == CALLS[:1]
    for size in (1, 2, 5, len(text)):
        calls, content = _streamed(fmt, text, size)
        assert calls == [(c.name, c.arguments) for c in CALLS] and content == ""
    assert _streamed(fmt, "Hello there", 3) == ([], "Hello there")


@pytest.mark.parametrize("fmt", JSON, ids=lambda f: f.name)
def test_a_reply_cut_short_keeps_the_calls_it_completed(fmt: ToolFormat[Any]) -> None:
    text = fmt.layout.calls_text(CALLS)
    first_end = len(fmt.layout.open) + len(fmt.layout.call_text(CALLS[0].name, CALLS[0].arguments))
    for cut in range(len(text)):
        done = fmt.layout.complete_calls(text[:cut])
        second_end = len(text) - len(fmt.layout.close)
        assert done == (CALLS if cut >= second_end else CALLS[:1] if cut >= first_end else [])
        # A reply cut right after a whole call (and before a close that the format has) is that call.
        whole = not fmt.layout.close and text[:cut].rstrip() == text[:first_end]
        assert fmt.layout.parse_calls(text[:cut]) == (CALLS[:1] if whole else None)


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("hermes", '<tool_call>\n{"name":"f","arguments":{"a":1}}\n</tool_call>', [("f", '{"a":1}')]),
        (
            "hermes",
            '<tool_call>{"name": "f", "arguments": {}}</tool_call>\n\n'
            '<tool_call>\n{"name": "g", "arguments": []}\n</tool_call>',
            [("f", "{}"), ("g", "[]")],
        ),
        ("llama3_json", '<|python_tag|>{"name": "f", "parameters": {"a": 1}}', [("f", '{"a": 1}')]),
        (
            "llama3_json",
            '{"name": "f", "arguments": {}}; {"name": "g", "parameters": {}}',
            [("f", "{}"), ("g", "{}")],
        ),
        ("mistral", '[TOOL_CALLS] [ {"name": "f", "arguments": {"a": "b"}} ]', [("f", '{"a": "b"}')]),
        ("phi4", '<|tool_call|>[{"name":"f","arguments":{}}]<|/tool_call|>', [("f", "{}")]),
    ],
)
def test_what_models_write_unconstrained_parses(
    name: str, text: str, expected: list[tuple[str, str]]
) -> None:
    calls = FORMATS[name].layout.parse_calls(text)
    assert calls is not None and [(c.name, c.arguments) for c in calls] == expected


HOSTILE = [
    "",
    "   ",
    "Hello",
    '<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n',
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}',
    '<tool_call>\n{"name": "bad name!", "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": "' + "x" * 65 + '", "arguments": {}}\n</tool_call>',
    '[TOOL_CALLS][{"name": "f", "arguments": {}}',
    '[TOOL_CALLS]{"name": "f", "arguments": {}}]',
    '<|tool_call|>[{"name": "f", "arguments": {}}]',
    '{"name": "f", "parameters": ' + "[" * 100_000 + "]" * 100_000 + "}",
    '{"name": "f", "parameters": ' + "[" * 100_000,
    '{"name": "f"}',
    '{"parameters": {}, "name": "f"}',
]


@pytest.mark.parametrize("fmt", ALL, ids=lambda f: f.name)
@pytest.mark.parametrize("text", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_text_is_no_call(fmt: ToolFormat[Any], text: str) -> None:
    assert fmt.layout.parse_calls(text) is None
    # A reply cut short keeps only whole calls, whose arguments are whole JSON values.
    for call in fmt.layout.complete_calls(text):
        json.loads(call.arguments)
    _streamed(fmt, text, 7)


def test_unknown_tool_names_are_not_calls_of_the_request() -> None:
    layout = FORMATS["hermes"].layout
    text = layout.calls_text([ParsedCall("rm_rf", "{}")])
    assert layout.parse_calls(text) == [ParsedCall("rm_rf", "{}")]
    assert layout.parse_calls(text, names={"get_weather"}) is None
    assert layout.parse_calls(text, names={"rm_rf"}) == [ParsedCall("rm_rf", "{}")]


_MARKUP = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "\n",
        '{"name": "f", "arguments": ',
        '{"name": "f", "parameters": ',
        "}",
        "{",
        "[",
        "]",
        '"',
        "[TOOL_CALLS][",
        "<|tool_call|>[",
        "]<|/tool_call|>",
        "<|python_tag|>",
        "; ",
        ", ",
        "<think>",
        "</think>",
        "\\",
    ]
)
_TEXTS = st.lists(st.one_of(_MARKUP, st.text(max_size=8)), max_size=24).map("".join)


@settings(max_examples=150, deadline=None)
@given(text=_TEXTS, size=st.integers(1, 9), opened=st.booleans())
def test_no_text_makes_a_parser_raise(text: str, size: int, opened: bool) -> None:
    for fmt in ALL:
        fmt.layout.parse_calls(text)
        fmt.layout.complete_calls(text)
        _streamed(fmt, text, size)
    _reasoning_streamed(text, size, opened)


def _reasoning_streamed(text: str, size: int, opened: bool) -> tuple[str, str]:
    stream = ReasoningStream(opened)
    reasoning = content = ""
    for i in range(0, len(text), size):
        r, c = stream.push(text[i : i + size])
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish()
    return reasoning + r, content + c


@settings(max_examples=150, deadline=None)
@given(text=_TEXTS, size=st.integers(1, 9), opened=st.booleans())
def test_streamed_reasoning_equals_the_whole_split(text: str, size: int, opened: bool) -> None:
    whole = split(text, opened)
    assert _reasoning_streamed(text, size, opened) == (whole.reasoning or "", whole.content)


@pytest.mark.parametrize(
    ("text", "opened", "reasoning", "content"),
    [
        ("<think>\nLet me see.\n</think>\n\nIt is 4.", False, "Let me see.", "It is 4."),
        ("  <think>a</think>b", False, "a", "b"),
        ("No thinking here.", False, None, "No thinking here."),
        ("I think <think> is a tag", False, None, "I think <think> is a tag"),
        ("<think>\ncut short", False, "cut short", ""),
        ("inside already\n</think>\n\nanswer", True, "inside already", "answer"),
        ("</think>answer", True, "", "answer"),
        ("<think>a</think>b</think>c", False, "a", "b</think>c"),
    ],
)
def test_think_blocks_split_as_vllm_returns_them(
    text: str, opened: bool, reasoning: str | None, content: str
) -> None:
    assert split(text, opened) == split(text, opened).__class__(reasoning, content)


def test_reasoning_streams_before_content() -> None:
    stream = ReasoningStream(False)
    pieces: list[Any] = [stream.push(p) for p in ["<thi", "nk>\nHm", "m.\n</th", "ink>\n", "\nYes", "."]]
    pieces.append(stream.finish())
    reasoning = [r for r, _ in pieces if r]
    content = [c for _, c in pieces if c]
    assert "".join(reasoning) == "Hmm." and "".join(content) == "Yes."
    last_reasoning = max(i for i, (r, _) in enumerate(pieces) if r)
    first_content = min(i for i, (_, c) in enumerate(pieces) if c)
    assert last_reasoning < first_content


def test_the_generation_prompt_says_whether_the_reply_starts_inside_a_think_block() -> None:
    assert opens_reasoning("<|im_start|>assistant\n<think>\n") and not closes_reasoning(
        "assistant\n<think>\n"
    )
    assert closes_reasoning("assistant\n<think>\n\n</think>\n\n") and not opens_reasoning("</think>\n\n")
    plain = "<|im_start|>assistant\n"
    assert not opens_reasoning(plain) and not closes_reasoning(plain)
    # A think block of an earlier turn is history, not the generation prompt's.
    assert not closes_reasoning("</think>\n\nHi<|im_end|>\n<|im_start|>assistant\n")
