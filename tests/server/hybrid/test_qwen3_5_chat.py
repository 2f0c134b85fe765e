"""Qwen3.5 (Gated DeltaNet layers beside gated attention) served over HTTP in its own formats, through
the official `openai` and `anthropic` clients: Qwen3's template (think blocks, `<tool_call>` calls),
so the server picks the hermes tool-call format and the think reasoning parser; a tool call forced by
tool_choice (grammar-constrained, so valid on random weights); and each chat's next turn read from the
cache up to everything before its new message, as with an attention model, with nothing recomputed for
want of a state checkpoint (/metrics)."""

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
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(
    serve_app: Callable[[FastAPI], AbstractContextManager[str]], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("qwen3_5")
    family, overrides = FAMILY_KINDS["qwen3_5-hybrid"]
    path = save_tiny_model(f"{folder}/m", family, max_position_embeddings=2048, **overrides)
    template = f"{folder}/qwen3.jinja"
    with open(template, "w") as f:
        f.write(chat_templates.QWEN3)
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
TOOL: Any = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}}


def test_openai_chat_and_a_forced_tool_call_read_the_previous_turn_from_the_cache(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    history: list[Any] = [
        {"role": "system", "content": "OpenAI turn. " + SYSTEM},
        {"role": "user", "content": "Say hello."},
    ]
    one = _chat(client, history, tools=[TOOL], tool_choice="none")
    assert one.usage.prompt_tokens_details.cached_tokens < 8
    history += [
        {"role": "assistant", "content": one.choices[0].message.content},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    # The grammar forces the call; with thinking off no think block may come first.
    forced = {"type": "function", "function": {"name": "get_weather"}}
    two = _chat(client, history, tools=[TOOL], tool_choice=forced, max_tokens=40, extra_body=NO_THINK)
    # Everything before the new message is read from the cache: turn 1's prompt and all of its reply
    # but the last sampled token, to the token, nothing recomputed for want of a checkpoint.
    assert two.usage.prompt_tokens_details.cached_tokens == one.usage.prompt_tokens + 8 - 1
    assert _recomputed(server) == 0
    assert two.choices[0].finish_reason == "tool_calls"
    (call,) = two.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    history += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."},
    ]
    three = _chat(client, history, tools=[TOOL])
    # The template re-renders turn 2's generation prompt without its empty think block, so the match
    # ends there; the state resumes from the last message end before it, a few tokens back (counted).
    prompt_two = two.usage.prompt_tokens
    assert prompt_two - 16 <= three.usage.prompt_tokens_details.cached_tokens < prompt_two
    assert 0 < _recomputed(server) < 16
    assert_no_leak(server.wait_idle())


def test_anthropic_chat_and_a_forced_tool_use_read_the_previous_turn_from_the_cache(server: Server) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    tool: Any = {"name": "get_weather", "description": "The weather.", "input_schema": WEATHER_PARAMETERS}
    system = "Anthropic turn. " + SYSTEM
    ask: Any = [{"role": "user", "content": "Say hello."}]
    fields: Any = {"model": NAME, "system": system, "tools": [tool], "extra_body": {"temperature": 0}}
    # Thinking left to the model, as the OpenAI turn above: the template's generation prompt is then
    # the one it renders the reply's turn with.
    adaptive: Any = {"type": "adaptive"}
    one = client.messages.create(
        messages=ask, max_tokens=8, tool_choice={"type": "none"}, thinking=adaptive, **fields
    )
    prompt_one = one.usage.input_tokens + (one.usage.cache_read_input_tokens or 0)
    # Turn 1 may recompute the template's opening it shares with the other test's chat.
    recomputed = _recomputed(server)
    history: Any = [
        *ask,
        {"role": "assistant", "content": [{"type": "text", "text": one.content[0].text}]},  # type: ignore[union-attr]
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    two = client.messages.create(
        messages=history,
        max_tokens=40,
        tool_choice={"type": "tool", "name": "get_weather"},
        thinking={"type": "disabled"},
        **fields,
    )
    assert two.usage.cache_read_input_tokens == prompt_one + one.usage.output_tokens - 1
    assert _recomputed(server) == recomputed
    assert two.stop_reason == "tool_use"
    (use,) = two.content
    assert use.type == "tool_use" and use.name == "get_weather"
    assert isinstance(use.input["city"], str)  # type: ignore[index]
    assert_no_leak(server.wait_idle())
