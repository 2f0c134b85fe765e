"""Each family's own chat format for tools and reasoning, through the official openai client against
real servers on loopback, each with a family's template installed on the default model's tokenizer
(`--chat-template`, tests/server/chat_templates.py).

The default model does not write these formats by itself: tool_choice required makes it (the grammar
is the format's), and a guided grammar makes it reason in a think block. For each family a tool call
round trip (call, result, answer), streamed and not, whose second turn reads the first turn's KV
through the call; the templates render tools, calls and results where the family's do; reasoning comes
back as reasoning_content and streams before the content; chat_template_kwargs reach the template and
bad ones are a 400; a 5-turn reasoning chat hits the cache up to the first changed token.
"""

import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any
from unittest.mock import patch

import httpx
import openai
import pytest
from fastapi import FastAPI
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.errors import ConfigError, InvalidRequestError
from kvserve.model.tokenizer import TemplateArgs
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from kvserve.server.core.chat_setup import chat_setup, read_chat_template
from kvserve.server.core.messages import ChatMessage
from kvserve.server.core.prompts import RESERVED_TEMPLATE_NAMES, template_kwargs
from kvserve.server.core.tool_formats import FORMATS, ToolFormat
from kvserve.server.core.tool_formats.layout import CallLayout
from kvserve.server.core.tools import conversation, template_tools
from kvserve.server.openai.convert import tool_use
from kvserve.server.openai.protocol import ChatCompletionRequest
from tests.server import chat_templates
from tests.server.live import Server, assert_no_leak

NAME = "m"
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
FAMILIES = {
    "hermes": chat_templates.QWEN3,
    "qwen3_xml": chat_templates.QWEN3_5,
    "llama3_json": chat_templates.LLAMA3,
    "mistral": chat_templates.MISTRAL,
    "phi4": chat_templates.PHI4,
}
NO_THINKING: Any = {"chat_template_kwargs": {"enable_thinking": False}}
# A reply that reasons, then answers: what a reasoning model writes, forced on the default model.
REASONING_GRAMMAR = 'start: "<think>\\n" /[a-z][a-z ]{2,28}[a-z]/ "\\n</think>\\n\\n" /[A-Z][a-z ]{4,30}/\n'


@pytest.fixture(scope="module")
def serve_template(
    make_engine: Callable[..., Engine],
    serve_app: Callable[[FastAPI], AbstractContextManager[str]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str], AbstractContextManager[tuple[Server, openai.OpenAI]]]:
    """`with serve_template(source) as (server, client):` a server whose chat template is `source`."""

    @contextmanager
    def serve(source: str) -> Iterator[tuple[Server, openai.OpenAI]]:
        path = tmp_path_factory.mktemp("template") / "chat_template.jinja"
        path.write_text(source)
        async_engine = AsyncEngine(make_engine(kv_cache_memory=64 * 2**20, max_model_len=1024))
        options = ServerOptions(served_model_name=NAME, chat_template=str(path))
        with serve_app(create_app(async_engine, options)) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
            yield Server(url, async_engine), client

    return serve


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(
    request: pytest.FixtureRequest,
    serve_template: Callable[[str], AbstractContextManager[tuple[Server, openai.OpenAI]]],
) -> Iterator[tuple[str, Server, openai.OpenAI]]:
    with serve_template(FAMILIES[request.param]) as (server, client):
        yield request.param, server, client


@pytest.fixture(scope="module")
def qwen3(
    serve_template: Callable[[str], AbstractContextManager[tuple[Server, openai.OpenAI]]],
) -> Iterator[tuple[Server, openai.OpenAI]]:
    with serve_template(chat_templates.QWEN3) as live:
        yield live


def test_auto_detection_picks_each_familys_format(default_tokenizer: Any) -> None:
    expected = {
        "QWEN3": ("hermes", True),
        "QWEN3_THINKING": ("hermes", True),
        "QWEN3_5": ("qwen3_xml", True),
        "LLAMA3": ("llama3_json", False),
        "MISTRAL": ("mistral", False),
        "PHI4": ("phi4", False),
    }
    for name, (fmt, reasoning) in expected.items():
        setup = chat_setup(default_tokenizer, getattr(chat_templates, name), "auto", "auto")
        assert (setup.tools.name, setup.reasoning) == (fmt, reasoning), name
    default = chat_setup(default_tokenizer, None, "auto", "auto")
    assert (default.tools.name, default.reasoning) == ("generic", False)
    forced = chat_setup(default_tokenizer, chat_templates.QWEN3, "generic", "off")
    assert (forced.tools.name, forced.reasoning) == ("generic", False)


@pytest.fixture(scope="module")
def default_tokenizer(default_model: Any) -> Any:
    return default_model.tokenizer


ARGS = '{"city":"Oslo"}'
HISTORY: Any = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "reasoning_content": "The user wants the weather.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
]
# Where each family's template puts the tools, the call (exactly as generated) and the result.
RENDERED = {
    "hermes": [
        "<tools>\n{",
        '<tool_call>\n{"name": "get_weather", "arguments": ' + ARGS + "}\n</tool_call><|im_end|>",
        "<|im_start|>user\n<tool_response>\nSunny, 21 C\n</tool_response><|im_end|>",
    ],
    "qwen3_xml": [
        "<tools>\n{",
        "<|im_start|>assistant\n<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n"
        "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call><|im_end|>",
        "<|im_start|>user\n<tool_response>\nSunny, 21 C\n</tool_response><|im_end|>",
    ],
    "llama3_json": [
        "Environment: ipython",
        '"name": "get_weather"',
        '<|end_header_id|>\n\n{"name": "get_weather", "parameters": ' + ARGS + "}<|eot_id|>",
        'ipython<|end_header_id|>\n\n"Sunny, 21 C"<|eot_id|>',
    ],
    "mistral": [
        '[AVAILABLE_TOOLS][{"type": "function"',
        '[/INST][TOOL_CALLS][{"name": "get_weather", "arguments": ' + ARGS + "}]",
        '[TOOL_RESULTS]{"content": "Sunny, 21 C", "call_id": "call_1"}[/TOOL_RESULTS]',
    ],
    "phi4": [
        '<|tool|>[{"type": "function"',
        '<|assistant|><|tool_call|>[{"name": "get_weather", "arguments": ' + ARGS + "}]<|/tool_call|><|end|>",
        "<|tool|>Sunny, 21 C<|end|>",
    ],
}


@pytest.mark.parametrize("name", list(RENDERED))
def test_each_template_renders_tools_calls_and_results_where_its_family_does(
    default_tokenizer: Any, name: str
) -> None:
    source = FAMILIES[name]
    setup = chat_setup(default_tokenizer, source, "auto", "auto")
    messages = [ChatMessage.model_validate(m) for m in HISTORY]
    use = tool_use(ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": [WEATHER]}))
    assert use is not None
    turns = conversation(messages, use, setup.tools)
    text = default_tokenizer.render_chat(turns, True, TemplateArgs(source, template_tools(use)))
    for piece in RENDERED[name]:
        assert piece in text, (name, piece, text)


def test_qwen3s_template_drops_reasoning_before_the_last_query_only(default_tokenizer: Any) -> None:
    setup = chat_setup(default_tokenizer, chat_templates.QWEN3, "auto", "auto")
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "greet back"},
        {"role": "user", "content": "Weather?"},
        *HISTORY[2:],
    ]
    turns = conversation([ChatMessage.model_validate(m) for m in history], None, setup.tools)
    text = default_tokenizer.render_chat(turns, True, TemplateArgs(chat_templates.QWEN3))
    assert "greet back" not in text and "<|im_start|>assistant\nHello.<|im_end|>" in text
    assert "<think>\nThe user wants the weather.\n</think>\n\n<tool_call>" in text


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", [{"role": "user", "content": "Weather in Oslo?"}])
    return client.chat.completions.create(model=NAME, **kwargs)


def _streamed_calls(client: openai.OpenAI, **kwargs: Any) -> tuple[list[dict[str, Any]], str | None, Any]:
    calls: dict[int, dict[str, Any]] = {}
    finish = usage = None
    for chunk in _chat(client, stream=True, stream_options={"include_usage": True}, **kwargs):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            assert not choice.delta.content, "no call markup reaches the content"
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = d.id or call["id"]
                if d.function and d.function.name:
                    call["name"] = d.function.name
                if d.function and d.function.arguments:
                    call["arguments"] += d.function.arguments
    return [calls[i] for i in sorted(calls)], finish, usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_call_round_trip_in_each_familys_format_hits_the_first_turns_cache(
    family: tuple[str, Server, openai.OpenAI], stream: bool
) -> None:
    name, server, client = family
    messages: list[Any] = [{"role": "user", "content": f"Weather in Oslo? ({name}, {stream})"}]
    kwargs: Any = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}
    kwargs |= {"max_tokens": 40, "temperature": 0}
    if name == "qwen3_xml":
        # Qwen3.5's template opens a think block unless told not to; it renders an empty one back.
        kwargs["extra_body"] = NO_THINKING
    if stream:
        calls, finish, first_usage = _streamed_calls(client, messages=messages, **kwargs)
    else:
        reply = _chat(client, messages=messages, **kwargs)
        first_usage, finish = reply.usage, reply.choices[0].finish_reason
        assert reply.choices[0].message.content is None
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in reply.choices[0].message.tool_calls or []
        ]
    assert finish == "tool_calls" and [c["name"] for c in calls] == ["get_weather"]
    assert isinstance(json.loads(calls[0]["arguments"])["city"], str)
    messages.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in calls
            ],
        }
    )
    messages.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": "Sunny, 21 C"})
    final_kwargs: Any = {"tools": [WEATHER], "tool_choice": "none", "max_tokens": 8, "temperature": 0}
    final_kwargs["extra_body"] = NO_THINKING
    if stream:
        chunks = list(
            _chat(
                client, messages=messages, stream=True, stream_options={"include_usage": True}, **final_kwargs
            )
        )
        usage = chunks[-1].usage
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        final = _chat(client, messages=messages, **final_kwargs)
        usage = final.usage
        assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    # Turn 2 reads turn 1's prompt and the call the model wrote from the cache: the template renders the
    # call as the exact text generated, whose ids the reply memory splices back in. Every token of turn
    # 1 but the last sampled one has its KV computed and cached.
    turn_1 = first_usage.prompt_tokens + first_usage.completion_tokens - 1
    assert usage is not None and usage.prompt_tokens_details.cached_tokens >= turn_1
    assert_no_leak(server.wait_idle())


def _reasoned(client: openai.OpenAI, messages: list[Any], **kwargs: Any) -> Any:
    return _chat(
        client,
        messages=messages,
        temperature=0,
        max_tokens=40,
        extra_body={"guided_grammar": REASONING_GRAMMAR},
        **kwargs,
    )


def test_reasoning_comes_back_as_reasoning_content_and_streams_first(
    qwen3: tuple[Server, openai.OpenAI],
) -> None:
    server, client = qwen3
    messages = [{"role": "user", "content": "Is the sky blue?"}]
    whole = _reasoned(client, messages).choices[0].message
    extra = whole.model_extra or {}
    assert whole.reasoning_content and extra["reasoning"] == whole.reasoning_content  # type: ignore[attr-defined]
    assert whole.content and "think>" not in whole.content and "think>" not in whole.reasoning_content  # type: ignore[attr-defined]
    kinds: list[str] = []
    reasoning = content = ""
    for chunk in _reasoned(client, messages, stream=True):
        for choice in chunk.choices:
            delta = choice.delta.model_extra or {}
            if delta.get("reasoning_content"):
                assert delta["reasoning"] == delta["reasoning_content"]
                reasoning += delta["reasoning_content"]
                kinds.append("reasoning")
            if choice.delta.content:
                content += choice.delta.content
                kinds.append("content")
    assert (reasoning, content) == (whole.reasoning_content, whole.content)  # type: ignore[attr-defined]
    assert (
        kinds == sorted(kinds, key=lambda k: k == "content") and "reasoning" in kinds and "content" in kinds
    )
    assert_no_leak(server.wait_idle())


def test_a_reasoning_reply_sent_back_apart_reads_its_kv_where_the_template_keeps_its_block(
    qwen3: tuple[Server, openai.OpenAI],
) -> None:
    """The client sends the reply back as content and reasoning_content; after the last user query
    (a tool loop) Qwen3's template renders the block again, and the reply's exact ids go back in."""
    server, client = qwen3
    messages: list[Any] = [{"role": "user", "content": "Check the sky, then answer."}]
    reply = _reasoned(client, messages)
    message = reply.choices[0].message
    messages.append(
        {"role": "assistant", "content": message.content, "reasoning_content": message.reasoning_content}
    )  # type: ignore[attr-defined]
    messages.append({"role": "tool", "tool_call_id": "call_1", "content": "Blue."})
    again = _chat(client, messages=messages, max_tokens=1, temperature=0).usage
    turn_1 = reply.usage.prompt_tokens + reply.usage.completion_tokens - 1
    assert again.prompt_tokens_details.cached_tokens >= turn_1
    assert_no_leak(server.wait_idle())


def test_chat_template_kwargs_reach_the_template_and_bad_ones_are_refused(
    qwen3: tuple[Server, openai.OpenAI],
) -> None:
    server, client = qwen3
    ask: Any = [{"role": "user", "content": "Hi"}]
    thinking = _chat(client, messages=ask, max_tokens=1).usage.prompt_tokens
    off = _chat(
        client, messages=ask, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    ).usage.prompt_tokens
    # enable_thinking=false writes an empty think block into the generation prompt.
    assert off > thinking
    bad: Any
    for bad in (
        {"messages": []},
        {"add_generation_prompt": False},
        {"bos_token": "x"},
        {"a b": 1},
        {"x": "y" * 9000},
        [1],
    ):
        r = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"model": NAME, "messages": ask, "max_tokens": 1, "chat_template_kwargs": bad},
            timeout=60,
        )
        assert 400 <= r.status_code < 500, (bad, r.text)
        if isinstance(bad, dict):
            assert r.json()["error"]["param"] == "chat_template_kwargs", r.text
    assert_no_leak(server.wait_idle())


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_five_turn_reasoning_chat_hits_the_cache_up_to_the_first_changed_token(
    qwen3: tuple[Server, openai.OpenAI], default_tokenizer: Any
) -> None:
    """Qwen3's template drops each earlier turn's think block, so turn k's prompt departs from turn
    k-1's prompt and output where that output's think block began: the ideal hit is their longest
    common token prefix, and the prefix cache gives it (within a block: cached tokens are whole blocks
    and what the last one shares). Prints the cached fraction and the ideal per turn."""
    server, client = qwen3
    token_of = {default_tokenizer.token_bytes(i): i for i in reversed(range(default_tokenizer.vocab_size))}
    block_size = server.call(lambda e: e.config.block_size)
    messages: list[Any] = [{"role": "system", "content": "You answer in a few words after thinking."}]
    previous: list[int] | None = None
    rows = []
    for turn in range(1, 6):
        messages.append({"role": "user", "content": f"Question {turn}: what comes after {turn}?"})
        prompt = httpx.post(f"{server.url}/tokenize", json={"model": NAME, "messages": messages}, timeout=60)
        prompt_ids: list[int] = prompt.json()["tokens"]
        reply = _reasoned(client, messages, logprobs=True, top_logprobs=0)
        usage = reply.usage
        assert usage.prompt_tokens == len(prompt_ids)
        cached = usage.prompt_tokens_details.cached_tokens
        ideal = 0 if previous is None else _common_prefix(prompt_ids, previous)
        rows.append((turn, usage.prompt_tokens, cached, ideal))
        if previous is not None:
            assert cached > ideal - block_size
        output_ids = [token_of[bytes(t.bytes)] for t in reply.choices[0].logprobs.content]
        previous = prompt_ids + output_ids
        # What a client sends back: the answer, without its reasoning.
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    print("\nturn  prompt  cached  ideal  cached/prompt  ideal/prompt")
    for turn, prompt_tokens, cached, ideal in rows:
        print(
            f"{turn:>4}  {prompt_tokens:>6}  {cached:>6}  {ideal:>5}  "
            f"{cached / prompt_tokens:>13.3f}  {ideal / prompt_tokens:>12.3f}"
        )
    assert_no_leak(server.wait_idle())


def test_a_chat_template_file_that_cannot_be_read_stops_the_server(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--chat-template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    (tmp_path / "bad.jinja").write_bytes(b"\xff\xfe{{")
    with pytest.raises(ConfigError, match="--chat-template"):
        read_chat_template(str(tmp_path / "bad.jinja"))


def test_a_format_whose_markup_the_tokenizer_holds_as_special_tokens_keeps_them(
    default_tokenizer: Any,
) -> None:
    """A reply's special tokens are dropped from its text by default; a format marked by one (Mistral's
    [TOOL_CALLS], Llama's <|python_tag|> in their own tokenizers) keeps them for tool requests."""
    assert not chat_setup(default_tokenizer, chat_templates.QWEN3, "auto", "auto").keep_special_tokens
    im_start = ToolFormat("im", CallLayout(open="<|im_start|>["), markers=("<|im_start|>",))
    with patch.dict(FORMATS, {"hermes": im_start}):
        assert chat_setup(default_tokenizer, chat_templates.QWEN3, "hermes", "auto").keep_special_tokens


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=200, deadline=None)
@given(raw=st.dictionaries(st.text(max_size=70), _JSON_VALUES, max_size=40))
def test_chat_template_kwargs_are_accepted_within_bounds_or_refused_with_a_400(raw: dict[str, Any]) -> None:
    try:
        checked = template_kwargs(raw)
    except InvalidRequestError as e:
        assert e.param == "chat_template_kwargs"
        return
    assert checked == raw and len(raw) <= 32 and len(json.dumps(raw)) <= 8192
    assert not set(raw) & RESERVED_TEMPLATE_NAMES and not any(k.endswith("_token") for k in raw)


def test_deeply_nested_chat_template_kwargs_are_refused() -> None:
    deep: Any = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(InvalidRequestError):
        template_kwargs({"x": deep})
