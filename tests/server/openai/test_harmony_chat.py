"""gpt-oss's harmony format over HTTP through the official openai SDK, on a tiny random gpt-oss with
gpt-oss's real chat template (tests/server/harmony_model.py): the reply's analysis channel comes back as
reasoning and its commentary call as a tool call; the reasoning effort reaches the system message; and
over a 5-request tool-calling chat every request reads all of the previous request's prompt and reply
from the cache (the ideal), where the template alone (which drops a past turn's analysis and writes a
call's header in another order than the model) would stop at the previous reply.
"""

import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import openai
import pytest
from fastapi import FastAPI
from openai.types.chat import ChatCompletionMessageFunctionToolCall

from kvserve.config import EngineConfig, default_cache_dir
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.model.loader import load_model
from kvserve.model.tokenizer import TemplateArgs
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from tests.server.harmony_model import save_harmony_gpt_oss
from tests.server.live import Server

NAME = "oss"
BLOCK = 16
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[Server]:
    path = save_harmony_gpt_oss(str(tmp_path_factory.mktemp("oss") / "model"))
    engine = Engine.from_config(
        EngineConfig(kv_cache_memory=64 * 2**20, max_model_len=4096, block_size=BLOCK),
        model=load_model(path, default_cache_dir()),
    )
    async_engine = AsyncEngine(engine)
    with serve_app(create_app(async_engine, ServerOptions(served_model_name=NAME))) as url:
        yield Server(url, async_engine)


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_a_reply_brings_its_analysis_as_reasoning_and_its_call_as_a_tool_call(server: Server) -> None:
    client = _client(server)
    reply = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS,
        tool_choice="required",
        reasoning_effort="low",
        max_tokens=64,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert (message.model_extra or {}).get("reasoning_content")
    assert message.tool_calls is not None and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert isinstance(call, ChatCompletionMessageFunctionToolCall)
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")

    stream = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=64,
        stream=True,
    )
    reasoning, calls = "", []
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            calls += delta.tool_calls or []
    assert reasoning == (message.model_extra or {})["reasoning_content"]
    assert [(c.function.name, c.function.arguments) for c in calls if c.function] == [
        (call.function.name, call.function.arguments)
    ]


def test_the_reasoning_effort_reaches_the_system_message(server: Server) -> None:
    tokenizer = server.async_engine.tokenizer
    for effort in ("low", "high"):
        text = tokenizer.render_chat(
            [{"role": "user", "content": "hi"}], True, TemplateArgs(kwargs={"reasoning_effort": effort})
        )
        assert f"Reasoning: {effort}" in text
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        _client(server).chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=1,
            extra_body={"reasoning_effort": "extreme"},
        )


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _template_ids(server: Server, messages: list[Any]) -> list[int]:
    """The conversation as the template alone renders it, tokenized (no reply spliced back)."""
    from kvserve.server.core.messages import ChatMessage
    from kvserve.server.core.prompts import harmony_conversation

    turns = harmony_conversation([ChatMessage(**m) for m in messages])
    tokenizer = server.async_engine.tokenizer
    return tokenizer.encode(tokenizer.render_chat(turns, True, TemplateArgs(tools=TOOLS)), False)


@pytest.mark.parametrize("send_reasoning", [True, False])
def test_a_tool_calling_chat_reads_every_earlier_request_from_the_cache(
    server: Server, send_reasoning: bool
) -> None:
    """Five requests of one agent loop, each the previous one's messages, its reply (a call) and the
    call's result, the reply's reasoning sent back or not. Ideal: all of the previous request's prompt
    and reply (less the stop token, which is never run). The template alone keeps less: it writes the
    call in another form (and without the reasoning, drops the analysis)."""
    client = _client(server)
    tokenizer = server.async_engine.tokenizer
    messages: list[Any] = [
        {"role": "system", "content": "You check the weather for travellers."},
        {"role": "user", "content": f"Paris or Rome this weekend? ({send_reasoning})"},
    ]
    last: tuple[int, int, list[int]] | None = None
    cached, ideal, template_only = [], [], []
    for step in range(5):
        reply = client.chat.completions.create(
            model=NAME, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=64
        )
        usage = reply.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        message = reply.choices[0].message
        assert message.tool_calls, step
        call = message.tool_calls[0]
        assert isinstance(call, ChatCompletionMessageFunctionToolCall)
        reasoning = (message.model_extra or {}).get("reasoning_content") or ""
        plain = _template_ids(server, messages)
        if last is not None:
            prompt_tokens, completion_tokens, earlier = last
            cached.append(usage.prompt_tokens_details.cached_tokens or 0)
            ideal.append(prompt_tokens + completion_tokens - 1)
            template_only.append(_common(plain, earlier))
        # What the model wrote (the grammar's form of an analysis and a call), after the prompt.
        written = (
            f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant<|channel|>commentary "
            f"to=functions.{call.function.name} <|constrain|>json<|message|>{call.function.arguments}"
        )
        last = (usage.prompt_tokens, usage.completion_tokens, plain + tokenizer.encode(written, False))
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [call.model_dump()],
                **({"reasoning_content": reasoning} if send_reasoning else {}),
            }
        )
        messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'})
    print(
        f"harmony 5-request tool chat (reasoning sent back: {send_reasoning}): cached {cached}, "
        f"ideal {ideal}, template alone {template_only}"
    )
    assert cached == ideal
    assert sum(template_only) < sum(ideal)


def test_the_responses_api_gives_a_reasoning_item_and_a_call_and_reads_its_turn_back(server: Server) -> None:
    client = _client(server)
    tools: Any = [{"type": "function", **TOOLS[0]["function"]}]
    first = client.responses.create(
        model=NAME,
        input="Which city, Paris or Rome?",
        tools=tools,
        tool_choice="required",
        reasoning={"effort": "high"},
        max_output_tokens=64,
    )
    kinds = [item.type for item in first.output]
    assert kinds == ["reasoning", "function_call"]
    call = first.output[1]
    assert call.type == "function_call" and call.name == "get_weather"
    second = client.responses.create(
        model=NAME,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}],
        tools=tools,
        tool_choice="required",
        reasoning={"effort": "high"},
        max_output_tokens=64,
    )
    assert first.usage is not None and second.usage is not None
    ideal = first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.input_tokens_details.cached_tokens == ideal


def test_the_anthropic_api_gives_thinking_and_tool_use_and_reads_its_turn_back(server: Server) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    tool: Any = {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": TOOLS[0]["function"]["parameters"],
    }
    messages: list[Any] = [{"role": "user", "content": "Paris or Rome, says the weather?"}]
    first = client.messages.create(
        model=NAME, max_tokens=64, messages=messages, tools=[tool], tool_choice={"type": "any"}
    )
    assert [b.type for b in first.content] == ["thinking", "tool_use"]
    assert first.stop_reason == "tool_use"
    use = first.content[1]
    assert use.type == "tool_use" and use.name == "get_weather" and use.input["city"] in ("Paris", "Rome")
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "clear"}]},
    ]
    second = client.messages.create(
        model=NAME, max_tokens=64, messages=messages, tools=[tool], tool_choice={"type": "any"}
    )
    u = first.usage
    prompt = u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
    assert second.usage.cache_read_input_tokens == prompt + u.output_tokens - 1
