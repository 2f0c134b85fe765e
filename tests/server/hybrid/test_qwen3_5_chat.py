"""Qwen3.5 (Gated DeltaNet layers beside gated attention) served over HTTP in its own formats, through
the official `openai` and `anthropic` clients: Qwen3.5's template (think blocks, XML tool calls), so the
server picks the qwen3_xml tool-call format and the think reasoning parser; tool calls forced by
tool_choice (grammar-constrained, so valid on random weights), whole and streamed alike; and each
chat's next turn read from the cache up to everything before its new message that the template renders
again, as with an attention model, with nothing recomputed for want of a state checkpoint (/metrics):
after a call, the call as the model wrote it; after a plain reply, up to the generation prompt's end of
the turn's header, where the template drops the empty think block."""

import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import anthropic
import httpx
import openai
import pytest
from fastapi import FastAPI

from kvserve.config import EngineConfig, default_cache_dir
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.model.loader import load_model
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from tests.helpers import save_tiny_model
from tests.model.family_cases import FAMILY_KINDS
from tests.server import chat_templates
from tests.server.live import Server, assert_no_leak

NAME = "qwen3.5-tiny"
SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 4
WEATHER_PARAMETERS: Any = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(
    serve_app: Callable[[FastAPI], AbstractContextManager[str]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("qwen3_5")
    family, overrides = FAMILY_KINDS["qwen3_5-hybrid"]
    path = save_tiny_model(f"{folder}/m", family, max_position_embeddings=2048, **overrides)
    template = f"{folder}/qwen3_5.jinja"
    with open(template, "w") as f:
        f.write(chat_templates.QWEN3_5)
    model = load_model(path, default_cache_dir())
    engine = Engine.from_config(EngineConfig(kv_cache_memory=16 * 2**20, max_model_len=2048), model=model)
    async_engine = AsyncEngine(engine)
    options = ServerOptions(served_model_name=NAME, chat_template=template)
    with serve_app(create_app(async_engine, options)) as url:
        yield Server(url, async_engine)


def _recomputed(server: Server) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    (line,) = [x for x in text.splitlines() if x.startswith("kvserve_state_recomputed_tokens_total")]
    return float(line.split()[-1])


def _chat(client: openai.OpenAI, messages: list[Any], **fields: Any) -> Any:
    return client.chat.completions.create(
        model=NAME, messages=messages, temperature=0, **{"max_tokens": 8, **fields}
    )


NO_THINK: Any = {"chat_template_kwargs": {"enable_thinking": False}}
# The generation prompt's part after the turn's header that the template drops from a plain reply's
# turn once a user message follows it.
EMPTY_THINK = "<think>\n\n</think>\n\n"
TOOL: Any = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}}


def _header_end(server: Server, prompt_tokens: int) -> int:
    """Where a prompt closed by an empty think block ends its generation prompt's turn header."""
    return prompt_tokens - len(server.async_engine.tokenizer.encode(EMPTY_THINK, add_special_tokens=False))


def test_openai_chat_and_forced_tool_calls_read_the_previous_turn_from_the_cache(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    history: list[Any] = [
        {"role": "system", "content": "OpenAI turn. " + SYSTEM},
        {"role": "user", "content": "Say hello."},
    ]
    one = _chat(client, history, tools=[TOOL], tool_choice="none", extra_body=NO_THINK)
    assert one.usage.prompt_tokens_details.cached_tokens < 8
    history += [
        {"role": "assistant", "content": one.choices[0].message.content},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    # The grammar forces the call; with thinking off no think block may come first.
    forced: Any = {"type": "function", "function": {"name": "get_weather"}}
    two = _chat(client, history, tools=[TOOL], tool_choice=forced, max_tokens=60, extra_body=NO_THINK)
    # Turn 1's reply renders without the empty think block: the match ends at its turn's header, where
    # a checkpoint of the generation prompt waits, nothing recomputed.
    assert two.usage.prompt_tokens_details.cached_tokens == _header_end(server, one.usage.prompt_tokens)
    assert _recomputed(server) == 0
    assert two.choices[0].finish_reason == "tool_calls"
    (call,) = two.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments["city"], str) and arguments["days"] in range(1, 10)
    # Streamed, the same call comes in pieces that add up to the same arguments.
    stream = client.chat.completions.create(
        model=NAME,
        messages=history,
        temperature=0,
        max_tokens=60,
        tools=[TOOL],
        tool_choice=forced,
        extra_body=NO_THINK,
        stream=True,
    )
    pieces: list[Any] = [d for chunk in stream for d in chunk.choices[0].delta.tool_calls or ()]
    assert pieces[0].id and pieces[0].function.name == "get_weather" and len(pieces) > 2
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    history += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."},
    ]
    three = _chat(client, history, tools=[TOOL])
    # The call renders back as the model wrote it: turn 2's prompt and all of its reply that a step
    # fed are read from the cache, all but its last token or the closing tags the grammar forced after
    # the last step.
    whole = two.usage.prompt_tokens + two.usage.completion_tokens
    assert whole - 8 <= three.usage.prompt_tokens_details.cached_tokens < whole
    assert _recomputed(server) == 0
    assert_no_leak(server.wait_idle())


def test_anthropic_chat_and_a_forced_tool_use_read_the_previous_turn_from_the_cache(server: Server) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    tool: Any = {"name": "get_weather", "description": "The weather.", "input_schema": WEATHER_PARAMETERS}
    system = "Anthropic turn. " + SYSTEM
    ask: Any = [{"role": "user", "content": "Say hello."}]
    fields: Any = {"model": NAME, "system": system, "tools": [tool], "extra_body": {"temperature": 0}}
    off: Any = {"type": "disabled"}
    one = client.messages.create(
        messages=ask, max_tokens=8, tool_choice={"type": "none"}, thinking=off, **fields
    )
    prompt_one = one.usage.input_tokens + (one.usage.cache_read_input_tokens or 0)
    recomputed = _recomputed(server)
    history: Any = [
        *ask,
        {"role": "assistant", "content": [{"type": "text", "text": one.content[0].text}]},  # type: ignore[union-attr]
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    forced: Any = {"type": "tool", "name": "get_weather"}
    two = client.messages.create(messages=history, max_tokens=60, tool_choice=forced, thinking=off, **fields)
    assert two.usage.cache_read_input_tokens == _header_end(server, prompt_one)
    assert _recomputed(server) == recomputed
    assert two.stop_reason == "tool_use"
    (use,) = two.content
    assert use.type == "tool_use" and use.name == "get_weather"
    assert isinstance(use.input["city"], str) and use.input["days"] in range(1, 10)  # type: ignore[index]
    history += [
        {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C."}],
        },
    ]
    three = client.messages.create(messages=history, max_tokens=8, thinking=off, **fields)
    prompt_two = two.usage.input_tokens + (two.usage.cache_read_input_tokens or 0)
    # The tool use's input comes back as an object and still renders as the model wrote it.
    whole = prompt_two + two.usage.output_tokens
    assert whole - 8 <= (three.usage.cache_read_input_tokens or 0) < whole
    assert _recomputed(server) == recomputed
    assert_no_leak(server.wait_idle())


def test_a_ten_step_agent_loop_reads_each_step_s_whole_history_from_the_cache(server: Server) -> None:
    """An agent's loop: each step a forced call, its result sent back, the whole history resent. Every
    step from the second reads the previous step's prompt and its call from the cache (less the closing
    tags the grammar forced after the last step), nothing recomputed for want of a checkpoint. Another
    agent's first step shares the tools block and may recompute it (no checkpoint lay where the prompts
    part), leaving a checkpoint there: a third agent's first step recomputes nothing."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    history: list[Any] = [
        {"role": "system", "content": "Agent loop. " + SYSTEM},
        {"role": "user", "content": "Check the weather in ten cities, one call at a time."},
    ]
    forced: Any = {"type": "function", "function": {"name": "get_weather"}}
    whole = 0
    fractions = []
    for step in range(10):
        reply = _chat(client, history, tools=[TOOL], tool_choice=forced, max_tokens=60, extra_body=NO_THINK)
        cached = reply.usage.prompt_tokens_details.cached_tokens
        if step:
            assert whole - 8 <= cached < whole, step
        else:
            before = _recomputed(server)
        fractions.append(cached / reply.usage.prompt_tokens)
        whole = reply.usage.prompt_tokens + reply.usage.completion_tokens
        (call,) = reply.choices[0].message.tool_calls
        history += [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
            {"role": "tool", "tool_call_id": call.id, "content": f"Step {step}: sunny, {15 + step} C."},
        ]
    print("cached fraction per step:", " ".join(f"{f:.3f}" for f in fractions))
    assert _recomputed(server) == before
    for name in ["Second", "Third"]:
        before = _recomputed(server)
        other = [{"role": "system", "content": f"{name} agent. {SYSTEM}"}, history[1]]
        first = _chat(client, other, tools=[TOOL], tool_choice=forced, max_tokens=8, extra_body=NO_THINK)
    assert first.usage.prompt_tokens_details.cached_tokens > 100
    assert _recomputed(server) == before
    assert_no_leak(server.wait_idle())
