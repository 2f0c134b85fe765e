"""The tools' grammar in every format, as the engine compiles it: token by token on the default
tokenizer, it takes exactly the calls the format's writer writes (a think block first when reasoning
is on, or the end of the block the prompt opened), text under auto and none, and refuses a call of a
function the request does not offer, text that starts as calls do under none, and a think block when
reasoning is off."""

from typing import Any

import pytest

from kvserve.engine.grammar import GrammarCompiler
from kvserve.server.core.reasoning import split
from kvserve.server.core.tool_formats import FORMATS, ToolFormat
from kvserve.server.core.tool_formats.layout import ParsedCall
from kvserve.server.core.tools import IN_THINK, MAY_THINK, NO_THINK, ToolUse, constraint
from kvserve.server.openai.convert import tool_use
from kvserve.server.openai.protocol import ChatCompletionRequest

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CALL = ParsedCall("get_weather", '{"city":"Oslo"}')
THINK = "<think>\nThe user wants < the weather.\n</think>\n\n"


@pytest.fixture(scope="module")
def compiler(default_model: Any) -> GrammarCompiler:
    tokenizer = default_model.tokenizer
    return GrammarCompiler(tokenizer.backend, tokenizer.vocab_size, tokenizer.eos_token_ids)


def _use(choice: Any) -> ToolUse:
    use = tool_use(
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "tool_choice": choice}
        )
    )
    assert use is not None
    return use


def _takes(
    compiler: GrammarCompiler, default_model: Any, use: ToolUse, fmt: ToolFormat[Any], think: str, text: str
) -> bool:
    """Whether the constraint takes `text`, tokenized, whole (and may end there)."""
    state = compiler.compile(constraint(use, fmt.layout, think)).start()
    ids = default_model.tokenizer.encode(text, add_special_tokens=False)
    return all(state.accept(t) for t in ids) and state.matcher.is_accepting()


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=lambda f: f.name)
def test_each_formats_grammar_takes_its_calls_and_refuses_the_rest(
    compiler: GrammarCompiler, default_model: Any, fmt: ToolFormat[Any]
) -> None:
    calls = fmt.layout.calls_text([CALL])
    two = fmt.layout.calls_text([CALL, CALL])
    other = fmt.layout.calls_text([ParsedCall("rm_rf", "{}")])

    def takes(choice: Any, think: str, text: str) -> bool:
        return _takes(compiler, default_model, _use(choice), fmt, think, text)

    assert takes("required", NO_THINK, calls) and takes("required", NO_THINK, two)
    assert takes({"type": "function", "function": {"name": "get_weather"}}, NO_THINK, calls)
    assert not takes({"type": "function", "function": {"name": "get_weather"}}, NO_THINK, two)
    assert not takes("required", NO_THINK, other)
    assert not takes("required", NO_THINK, "Sunny.")
    assert takes("auto", NO_THINK, calls) and takes("auto", NO_THINK, "Sunny.")
    assert takes("none", NO_THINK, "Sunny.") and not takes("none", NO_THINK, calls)
    # Reasoning first, then the calls, which parse as the reply's tool calls.
    assert takes("required", MAY_THINK, THINK + calls) and takes("required", MAY_THINK, calls)
    assert not takes("required", NO_THINK, THINK + calls)
    assert takes("none", MAY_THINK, THINK + "Sunny.")
    opened = "The user wants the weather.\n</think>\n\n"
    assert takes("required", IN_THINK, opened + calls) and not takes("required", IN_THINK, calls)
    parts = split(THINK + calls, opened=False)
    assert parts.reasoning == "The user wants < the weather." and fmt.layout.parse_calls(parts.content) == [
        CALL
    ]
