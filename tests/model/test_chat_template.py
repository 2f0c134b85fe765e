"""Chat templates render with jinja2 alone exactly as transformers' apply_chat_template renders them:
the templates of several families (their tools, calls, results and think blocks), conversations with
None-valued keys, reasoning under each of its names, tools, template variables and the special tokens,
and the same errors."""

import os
from dataclasses import replace
from typing import Any

import jinja2
import pytest
from benchmarks.peer_models import SPECIALS
from transformers import AutoTokenizer

from kvserve.config import default_cache_dir
from kvserve.model.loader import load_default_tokenizer, tokenizer_dir
from kvserve.model.tokenizer import TemplateArgs, Tokenizer
from tests.server.chat_templates import LLAMA3, MISTRAL, PHI4, QWEN3, QWEN3_THINKING

with open(os.path.join(os.path.dirname(__file__), "..", "server", "gpt_oss_chat_template.jinja")) as f:
    GPT_OSS = f.read()

# Jinja features that templates use and that the environment must give as transformers' does.
FEATURES = r"""{%- set ns = namespace(n=0) -%}
{%- for m in messages -%}
{%- if loop.index > 9 %}{% break %}{% endif -%}
{%- set ns.n = ns.n + 1 -%}
{%- if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}
{%- else %}{{ m | tojson(indent=2) }}{{ dict(a=1) | tojson }}{{ dict.fromkeys(['k']) | tojson }}{% endif -%}
{%- endfor -%}
{{ ns.n }}|{{ bos_token }}|{{ eos_token }}|{{ tools | tojson }}|{{ documents }}|{{ custom | default('none') }}
{%- if add_generation_prompt %}<go>{% endif %}"""

TEMPLATES = {
    "default": None,
    "qwen3": QWEN3,
    "qwen3_thinking": QWEN3_THINKING,
    "llama3": LLAMA3,
    "mistral": MISTRAL,
    "phi4": PHI4,
    "gemma3": SPECIALS["gemma3"].template,
    "qwen2.5": SPECIALS["qwen2"].template,
    "gpt_oss": GPT_OSS,
    "features": FEATURES,
}

RAISING: set[tuple[str, str]] = set()

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city, «en français» too",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "one user turn": [{"role": "user", "content": "Hello <b>there</b> & ünïcödé"}],
    "system and turns": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "tool call and result": [
        {"role": "user", "content": "Weather in Paris?", "name": None},
        {"role": "assistant", "content": "", "tool_calls": [CALL], "reasoning_content": None},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp": 21}'},
    ],
    "reasoning by its names": [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "Done.", "reasoning_content": "Let me see."},
        {"role": "user", "content": "Again."},
        {"role": "assistant", "content": "Done again.", "reasoning": "Once more."},
        {"role": "user", "content": "And now?"},
    ],
    "reasoning of the last turn": [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "Done.", "reasoning": "Let me see."},
    ],
}


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return load_default_tokenizer()


@pytest.fixture(scope="module")
def theirs() -> Any:
    return AutoTokenizer.from_pretrained(tokenizer_dir(None, default_cache_dir()), local_files_only=True)


def _both(ours: Tokenizer, theirs: Any, source: str | None, messages: Any, **options: Any) -> tuple[Any, Any]:
    """What each renders, or the class of what each raises."""
    tools, generation, kwargs = (
        options.get("tools"),
        options.get("add_generation_prompt", True),
        options.get("kwargs", {}),
    )
    try:
        mine: Any = ours.render_chat(messages, generation, TemplateArgs(source, tools, kwargs))
    except Exception as e:
        mine = type(e)
    try:
        reference: Any = theirs.apply_chat_template(
            messages,
            tools=tools,
            chat_template=source,
            tokenize=False,
            add_generation_prompt=generation,
            **kwargs,
        )
    except Exception as e:
        reference = type(e)
    return mine, reference


@pytest.mark.parametrize("template", sorted(TEMPLATES))
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("generation", [False, True])
def test_rendering_is_transformers(
    ours: Tokenizer, theirs: Any, template: str, conversation: str, with_tools: bool, generation: bool
) -> None:
    messages = CONVERSATIONS[conversation]
    mine, reference = _both(
        ours,
        theirs,
        TEMPLATES[template],
        messages,
        tools=TOOLS if with_tools else None,
        add_generation_prompt=generation,
        kwargs={"enable_thinking": False, "custom": "x"} if generation else {},
    )
    assert mine == reference
    assert isinstance(mine, str) or (template, conversation) in RAISING, mine


def test_the_callers_variables_win_over_the_special_tokens(ours: Tokenizer, theirs: Any) -> None:
    messages = CONVERSATIONS["one user turn"]
    mine, reference = _both(ours, theirs, FEATURES, messages, kwargs={"bos_token": "<mine>"})
    assert mine == reference and "|<mine>|" in mine


@pytest.mark.parametrize(
    ("source", "messages"),
    [
        ("{{ raise_exception('no system role') }}", CONVERSATIONS["one user turn"]),
        ("{% set ns = namespace(_x=1) %}", CONVERSATIONS["one user turn"]),
        ("{{ messages[0].__class__ }}", CONVERSATIONS["one user turn"]),
        ("{{ messages }}", []),
        ("{{ messages }}", ["not a message"]),
        ("{{ messages }}", [[{"role": "user", "content": "a batch"}]]),
        ("{% for %}", CONVERSATIONS["one user turn"]),
    ],
)
def test_errors_are_transformers(ours: Tokenizer, theirs: Any, source: str, messages: Any) -> None:
    mine, reference = _both(ours, theirs, source, messages)
    if messages and isinstance(messages[0], list):
        # transformers takes a list of lists as a batch of conversations; a request's messages are never one.
        assert mine is TypeError
    elif isinstance(reference, type) and issubclass(reference, jinja2.TemplateError):
        assert isinstance(mine, type) and issubclass(mine, jinja2.TemplateError)
    else:
        assert mine == reference


def test_a_named_template_of_several(ours: Tokenizer) -> None:
    """A tokenizer with several templates renders its "tool_use" one where tools are given, its default
    one otherwise, and one named by `source`."""
    several = {"default": "default:{{ messages[0].content }}", "tool_use": "tools:{{ tools is none }}"}
    mine = Tokenizer(ours.backend, replace(ours.specials, chat_template=several))
    theirs = AutoTokenizer.from_pretrained(tokenizer_dir(None, default_cache_dir()), local_files_only=True)
    theirs.chat_template = several
    for source, tools in ((None, None), (None, TOOLS), ("tool_use", None), ("default", TOOLS)):
        rendered, reference = _both(mine, theirs, source, CONVERSATIONS["one user turn"], tools=tools)
        assert rendered == reference and isinstance(rendered, str)
