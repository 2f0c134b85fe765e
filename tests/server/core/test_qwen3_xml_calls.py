"""Qwen3.5's XML tool calls (server/core/tool_formats/qwen3_xml.py) without a model: values typed by the
tools' schemas, written back as the very text the model wrote, streamed in any chunking as the whole
parse reads them (hypothesis over the split points), text before the calls as content, hostile text no
call and no exception, and the grammar on the default tokenizer."""

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.grammar import GrammarCompiler
from kvserve.errors import InvalidRequestError
from kvserve.model.tokenizer import TemplateArgs
from kvserve.server.core.tool_formats import FORMATS, choose
from kvserve.server.core.tool_formats.layout import ParsedCall
from kvserve.server.core.tool_formats.qwen3_xml import QWEN3_XML, XmlCalls
from kvserve.server.core.tools import NO_THINK, Tool, ToolUse, constraint
from tests.server import chat_templates

WEATHER: Any = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "units": {"enum": ["C", "F"]},
        "zone": {"type": "string", "minLength": 2, "maxLength": 3},
        "detail": {"type": "object"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "hourly": {"type": "boolean"},
    },
    "required": ["city"],
}
SYNTAX = QWEN3_XML.layout.bind([("get_weather", WEATHER), ("note", {"type": "object"})])

CALL = (
    "<tool_call>\n<function=get_weather>\n"
    '<parameter=city>\nSão "Paulo"\n\\ </x>\n</parameter>\n'
    "<parameter=days>\n3\n</parameter>\n"
    "<parameter=units>\nC\n</parameter>\n"
    '<parameter=detail>\n{"a": [1, 2.50], "b": null}\n</parameter>\n'
    '<parameter=tags>\n["x","y"]\n</parameter>\n'
    "<parameter=hourly>\ntrue\n</parameter>\n"
    "</function>\n</tool_call>"
)
CALL_ARGS = (
    '{"city":"São \\"Paulo\\"\\n\\\\ </x>","days":3,"units":"C","detail":{"a": [1, 2.50], "b": null},'
    '"tags":["x","y"],"hourly":true}'
)
NOTE = "<tool_call>\n<function=note>\n<parameter=text>\n42\n</parameter>\n</function>\n</tool_call>"
REPLY = "Let me look that up.\n\n" + CALL + "\n" + NOTE


def _streamed(syntax: XmlCalls, pieces: list[str]) -> tuple[list[tuple[str, str]], str]:
    """The calls and the content a stream of `pieces` sends, its held text included."""
    stream = syntax.stream()
    got: dict[int, dict[str, str]] = {}
    content = ""
    for piece in pieces:
        delta = stream.push(piece)
        content += delta.get("content", "")
        for d in delta.get("tool_calls", []):
            entry = got.setdefault(d["index"], {"name": "", "arguments": ""})
            entry["name"] += d.get("function", {}).get("name", "")
            entry["arguments"] += d["function"]["arguments"]
    content += stream.finish()
    return [(g["name"], g["arguments"]) for g in got.values()], content


def test_values_take_their_schemas_types_and_write_back_as_the_model_wrote_them() -> None:
    calls = SYNTAX.parse_calls(REPLY, {"get_weather", "note"})
    assert calls == [ParsedCall("get_weather", CALL_ARGS), ParsedCall("note", '{"text":"42"}')]
    assert json.loads(calls[0].arguments)["days"] == 3
    assert SYNTAX.lead(REPLY) == "Let me look that up."
    # The next turn's prompt: content and calls give back the reply's exact text.
    assert SYNTAX.reply_text("Let me look that up.", calls) == REPLY
    assert SYNTAX.reply_text("", calls[1:]) == NOTE
    # A typed value that is not JSON stays its text; a string stays a string; unbound, all are strings.
    odd = CALL.replace("\n3\n", "\nthree\n")
    assert json.loads(SYNTAX.parse_calls(odd)[0].arguments)["days"] == "three"  # type: ignore[index]
    assert json.loads(QWEN3_XML.layout.parse_calls(CALL)[0].arguments)["days"] == "3"  # type: ignore[index]
    assert SYNTAX.parse_calls(REPLY, {"get_weather"}) is None
    # Other whitespace between the tags parses too.
    loose = "<tool_call><function=note>  <parameter=text>hi</parameter></function> </tool_call>\n"
    assert SYNTAX.parse_calls(loose) == [ParsedCall("note", '{"text":"hi"}')]


def test_arguments_a_client_reserializes_still_write_back() -> None:
    calls = [ParsedCall("get_weather", json.dumps({"city": "Oslo", "days": 2, "tags": []}))]
    assert SYNTAX.reply_text("", calls) == (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n<parameter=tags>\n[]\n</parameter>\n</function>\n</tool_call>"
    )
    with pytest.raises(InvalidRequestError, match="JSON object"):
        SYNTAX.reply_text("", [ParsedCall("note", "[1]")])


def test_a_reply_cut_short_keeps_the_calls_it_completed() -> None:
    first_end = REPLY.index(CALL) + len(CALL)
    for cut in range(len(REPLY) + 1):
        done = SYNTAX.complete_calls(REPLY[:cut])
        assert len(done) == (2 if cut == len(REPLY) else 1 if cut >= first_end else 0)


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, len(REPLY)), max_size=40))
def test_any_split_streams_the_whole_parse(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(REPLY)]
    pieces = [REPLY[a:b] for a, b in itertools.pairwise(bounds)]
    calls = SYNTAX.parse_calls(REPLY)
    assert calls is not None
    assert _streamed(SYNTAX, pieces) == ([(c.name, c.arguments) for c in calls], "Let me look that up.")


_MARKUP = st.sampled_from(
    [
        *("<tool_call>", "</tool_call>", "<function=f>", "</function>", "<parameter=a>", "</parameter>"),
        *("\n", "\n\n", "{", '"', "<", "</", "[1", "3", "true"),
    ]
)
_TEXTS = st.lists(st.one_of(_MARKUP, st.text(max_size=6)), max_size=30).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=_TEXTS, cuts=st.lists(st.integers(0, 200), max_size=12))
def test_any_text_streams_as_it_parses_and_never_raises(text: str, cuts: list[int]) -> None:
    bounds = [0, *sorted(min(c, len(text)) for c in cuts), len(text)]
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    streamed, content = _streamed(SYNTAX, pieces)
    calls = SYNTAX.parse_calls(text)
    for c in SYNTAX.complete_calls(text):
        json.loads(c.arguments)
    if calls is not None:
        assert streamed == [(c.name, c.arguments) for c in calls]
        assert content == (SYNTAX.lead(text) or "")
        assert SYNTAX.parse_calls(SYNTAX.reply_text(content, calls)) == calls
    elif not SYNTAX.is_call_text(text):
        assert (streamed, content) == ([], text)


def test_auto_picks_the_xml_format_for_qwen3_5s_template() -> None:
    assert choose("auto", chat_templates.QWEN3_5, True) is QWEN3_XML
    assert choose("auto", chat_templates.QWEN3, True) is FORMATS["hermes"]


@pytest.fixture(scope="module")
def compiler(default_model: Any) -> GrammarCompiler:
    tokenizer = default_model.tokenizer
    return GrammarCompiler(tokenizer.backend, tokenizer.vocab_size, tokenizer.eos_token_ids)


def test_the_grammar_takes_the_written_calls_and_refuses_the_rest(
    compiler: GrammarCompiler, default_model: Any
) -> None:
    tools = (Tool("get_weather", "", WEATHER), Tool("note", "", {"type": "object"}))

    def takes(choice: str, text: str) -> bool:
        state = compiler.compile(constraint(ToolUse(tools, choice), QWEN3_XML.layout, NO_THINK)).start()
        ids = default_model.tokenizer.encode(text, add_special_tokens=False)
        return all(state.accept(t) for t in ids) and state.matcher.is_accepting()

    weather = SYNTAX.calls_text([ParsedCall("get_weather", '{"city":"Oslo","days":3,"detail":{"a":1}}')])
    note = SYNTAX.calls_text([ParsedCall("note", '{"text":"a\\nb","n":"1"}')])
    assert takes("required", weather) and takes("required", weather + "\n" + note)
    assert takes("get_weather", weather) and not takes("get_weather", note)
    assert takes("auto", "Checking.\n\n" + weather + "\n" + note) and takes("auto", "Sunny.")
    assert not takes("auto", "Checking.\n" + weather) and not takes("auto", "Sunny <tool_call>")
    assert not takes("none", weather) and takes("none", "Sunny.")
    # Typed values are JSON of their schema, the required ones present, in the schema's order.
    assert not takes("required", weather.replace("\n3\n", "\nthree\n"))
    assert not takes("required", SYNTAX.calls_text([ParsedCall("get_weather", '{"days":3}')]))
    assert not takes("required", SYNTAX.calls_text([ParsedCall("get_weather", '{"days":3,"city":"x"}')]))
    assert takes("required", SYNTAX.calls_text([ParsedCall("get_weather", '{"city":"x","units":"F"}')]))
    assert not takes("required", SYNTAX.calls_text([ParsedCall("get_weather", '{"city":"x","units":"K"}')]))
    for zone, ok in (("U", False), ("UTC", True), ("UTC+1", False)):
        zoned = SYNTAX.calls_text([ParsedCall("get_weather", json.dumps({"city": "x", "zone": zone}))])
        assert takes("required", zoned) == ok


def test_the_written_calls_are_what_qwen3_5s_template_renders_from_tool_calls(default_model: Any) -> None:
    """A client's calls written into the assistant's text render exactly as the template's own rendering
    of `tool_calls`: the form the model was trained on, text before them included."""
    arguments = {"city": "Oslo", "days": 3, "tags": ["a", "b"], "hourly": False}
    calls = [ParsedCall("get_weather", json.dumps(arguments)), ParsedCall("note", '{"text":"x\\ny"}')]
    template_calls = [
        {"type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
        for c in calls
    ]
    args = TemplateArgs(source=chat_templates.QWEN3_5)
    user = {"role": "user", "content": "Weather?"}
    for content in ("", "Checking."):
        ours = [user, {"role": "assistant", "content": SYNTAX.reply_text(content, calls)}]
        theirs = [user, {"role": "assistant", "content": content, "tool_calls": template_calls}]
        render = default_model.tokenizer.render_chat
        assert render(ours, False, args) == render(theirs, False, args)
