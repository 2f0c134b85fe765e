"""Structured outputs and tools over HTTP, through the official openai client, on the default model.

Every dialect (response_format, structured_outputs, guided_*), on chat and completions, whole and
streamed; `chat.completions.parse` with a pydantic model; a tool-call round trip (call, tool result,
final answer), streamed and not, whose second turn hits the first turn's KV; tool_choice required and
named; the generic tool format parsed and streamed as OpenAI streams it.
"""

import json
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from fastapi import FastAPI
from pydantic import BaseModel, Field

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from kvserve.server.core.tool_formats.generic import GENERIC
from kvserve.server.core.tool_formats.stream import CallStream
from tests.server.live import Server, assert_no_leak

NAME = "m"
ASK = [{"role": "user", "content": "Describe a fictional person."}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME: Any = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def server(
    make_engine: Callable[..., Engine], serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[Server]:
    async_engine = AsyncEngine(make_engine(kv_cache_memory=64 * 2**20, max_model_len=1024))
    with serve_app(create_app(async_engine, ServerOptions(served_model_name=NAME))) as url:
        yield Server(url, async_engine)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(model=NAME, messages=kwargs.pop("messages", ASK), **kwargs)


def test_response_format_json_schema_and_json_object(client: openai.OpenAI) -> None:
    schema_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "p", "schema": PERSON, "strict": True},
    }
    for kwargs in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        reply = _chat(client, response_format=schema_format, max_tokens=60, **kwargs).choices[0]
        assert reply.finish_reason == "stop"
        jsonschema.validate(json.loads(reply.message.content), PERSON)
    reply = _chat(client, response_format={"type": "json_object"}, max_tokens=60, temperature=0).choices[0]
    if reply.finish_reason == "stop":
        assert isinstance(json.loads(reply.message.content), dict)
    else:
        assert reply.message.content.startswith("{")


def test_vllm_dialects_on_chat_and_completions_streamed_or_not(client: openai.OpenAI) -> None:
    cases: list[tuple[dict[str, Any], Callable[[str], Any]]] = [
        (
            {"structured_outputs": {"regex": r"[A-Z][a-z]{2,8} [0-9]{2}"}},
            lambda t: re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{2}", t),
        ),
        (
            {"structured_outputs": {"choice": ["red", "green", "blue"]}},
            lambda t: t in ("red", "green", "blue"),
        ),
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"guided_regex": r"[0-9]{3}"}, lambda t: re.fullmatch(r"[0-9]{3}", t)),
        ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
        (
            {"structured_outputs": {"json": PERSON}},
            lambda t: jsonschema.validate(json.loads(t), PERSON) is None,
        ),
        ({"guided_grammar": 'start: "x" NUM\nNUM: /[1-9]/'}, lambda t: re.fullmatch(r"x[1-9]", t)),
    ]
    for extra, ok in cases:
        whole = _chat(client, max_tokens=60, temperature=0, extra_body=extra).choices[0]
        assert whole.finish_reason == "stop" and ok(whole.message.content), (extra, whole.message.content)
        text = "".join(
            c.choices[0].delta.content or ""
            for c in _chat(client, max_tokens=60, temperature=0, stream=True, extra_body=extra)
            if c.choices
        )
        assert text == whole.message.content
        completion = client.completions.create(
            model=NAME, prompt="Answer:", max_tokens=60, temperature=0, extra_body=extra
        ).choices[0]
        assert completion.finish_reason == "stop" and ok(completion.text), (extra, completion.text)


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=120)
        role: Literal["admin", "user"]

    parsed = client.chat.completions.parse(
        model=NAME,
        messages=ASK,  # type: ignore[arg-type]
        response_format=Person,
        max_tokens=80,
        temperature=0,
    )
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"guided_regex": "(ab"}, "regex"),
        ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}}, "json"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
        ({"tools": [WEATHER], "guided_regex": "a"}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nope"}}}]},
            "tools",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
    ],
)
def test_bad_constraints_are_a_400_naming_the_problem(
    server: Server, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(
        f"{server.url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body}, timeout=120
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert_no_leak(server.call(lambda e: e.stats()))


def test_tool_choice_required_and_named(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "What time is it in Paris, and what is the weather?"}]
    # One call: this small model repeats a call until max_tokens when it may make several.
    required = _chat(
        client,
        messages=ask,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    ).choices[0]
    assert required.finish_reason == "tool_calls" and required.message.tool_calls
    for call in required.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    named = _chat(
        client,
        messages=ask,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=60,
        temperature=0,
    ).choices[0]
    assert named.finish_reason == "tool_calls"
    assert [c.function.name for c in named.message.tool_calls or []] == ["get_time"]
    assert json.loads(named.message.tool_calls[0].function.arguments)["zone"] in ("UTC", "CET", "PST")


def test_calls_cut_short_by_max_tokens_keep_the_complete_ones(client: openai.OpenAI) -> None:
    """This model repeats a call until max_tokens when it may make several: the calls it completed come
    back as tool_calls with finish_reason "length", the unfinished one is dropped, and no call markup is
    ever the content."""
    ask = [{"role": "user", "content": "What time is it in Paris, and what is the weather?"}]
    for max_tokens, some_calls in ((120, True), (5, False)):
        reply = _chat(
            client,
            messages=ask,
            tools=[WEATHER, TIME],
            tool_choice="required",
            max_tokens=max_tokens,
            temperature=0,
        ).choices[0]
        assert reply.finish_reason == "length" and reply.message.content is None
        assert bool(reply.message.tool_calls) == some_calls
        for call in reply.message.tool_calls or []:
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_a_reply_cut_short_keeps_the_calls_it_completed() -> None:
    calls = [
        GENERIC.layout.call_text("get_weather", '{"city":"Oslo"}'),
        GENERIC.layout.call_text("get_time", '{"zone":"UTC"}'),
    ]
    text = "\n".join(calls)
    for cut in range(len(text) + 1):
        done = [c for c in calls if len(text[:cut]) >= text.index(c) + len(c)]
        assert [
            GENERIC.layout.call_text(c.name, c.arguments) for c in GENERIC.layout.complete_calls(text[:cut])
        ] == done
    assert GENERIC.layout.complete_calls("Hello <tool_call>") == []


def _streamed_calls(client: openai.OpenAI, **kwargs: Any) -> tuple[list[dict[str, Any]], str | None, Any]:
    """Tool calls put together from a stream's deltas, the finish reason and the usage."""
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    usage = None
    for chunk in _chat(client, stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    call["id"] = d.id
                if d.function and d.function.name:
                    call["name"] = d.function.name
                if d.function and d.function.arguments:
                    call["arguments"] += d.function.arguments
    return [calls[i] for i in sorted(calls)], finish, usage


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_round_trip_hits_the_first_turns_cache(
    server: Server, client: openai.OpenAI, stream: bool
) -> None:
    messages: list[Any] = [
        {"role": "user", "content": f"Weather in Oslo? ({'streamed' if stream else 'whole'})"}
    ]
    kwargs: Any = {
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 60,
        "temperature": 0,
    }
    if stream:
        calls, finish, first_usage = _streamed_calls(client, messages=messages, **kwargs)
    else:
        reply = _chat(client, messages=messages, **kwargs)
        first_usage = reply.usage
        finish = reply.choices[0].finish_reason
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in reply.choices[0].message.tool_calls or []
        ]
    assert finish == "tool_calls" and len(calls) >= 1 and calls[0]["name"] == "get_weather"
    json.loads(calls[0]["arguments"])
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
    messages += [{"role": "tool", "tool_call_id": c["id"], "content": "Sunny, 21 C"} for c in calls]
    final_kwargs: Any = {"tools": [WEATHER], "tool_choice": "none", "max_tokens": 12, "temperature": 0}
    if stream:
        chunks = list(
            _chat(
                client, messages=messages, stream=True, stream_options={"include_usage": True}, **final_kwargs
            )
        )
        usage = chunks[-1].usage
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text and not text.startswith("<")
    else:
        final = _chat(client, messages=messages, **final_kwargs)
        usage = final.usage
        assert final.choices[0].message.content
    # Turn 2 reads turn 1's prompt and the call the model wrote from the cache (the call's exact ids
    # come back from the reply memory); only the tool result and what follows are computed.
    # Every token of turn 1 but the last sampled one has its KV computed and cached.
    turn_1 = first_usage.prompt_tokens + first_usage.completion_tokens - 1
    assert usage is not None and usage.prompt_tokens_details.cached_tokens >= turn_1
    assert_no_leak(server.call(lambda e: e.stats()))


def test_auto_may_answer_in_text_or_with_calls(client: openai.OpenAI) -> None:
    reply = _chat(client, tools=[WEATHER], tool_choice="auto", max_tokens=40, temperature=0).choices[0]
    if reply.message.tool_calls:
        assert reply.finish_reason == "tool_calls"
    else:
        assert reply.message.content and not reply.message.content.startswith("<")


def test_the_generic_format_parses_and_streams_like_openai() -> None:
    args = ['{"city":"Oslo}</tool_call>"}', '{"zone":"UTC"}']
    text = (
        GENERIC.layout.call_text("get_weather", args[0])
        + "\n"
        + GENERIC.layout.call_text("get_time", args[1])
    )
    calls = GENERIC.layout.parse_calls(text)
    assert calls is not None and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", args[0]),
        ("get_time", args[1]),
    ]
    assert (
        GENERIC.layout.parse_calls("Hello") is None and GENERIC.layout.parse_calls(text + "trailing") is None
    )
    for size in (1, 3, 7, len(text)):
        stream = CallStream(GENERIC.layout)
        got: dict[int, dict[str, str]] = {}
        for i in range(0, len(text), size):
            for d in stream.push(text[i : i + size]).get("tool_calls", []):
                entry = got.setdefault(d["index"], {"name": "", "arguments": ""})
                entry["name"] += d.get("function", {}).get("name", "")
                entry["arguments"] += d["function"]["arguments"]
        assert [(g["name"], g["arguments"]) for g in got.values()] == [
            ("get_weather", args[0]),
            ("get_time", args[1]),
        ]
        assert stream.num_calls == 2
    plain = CallStream(GENERIC.layout)
    assert plain.push("Hi") == {"content": "Hi"} and plain.push(" there") == {"content": " there"}


def test_tool_choice_none_keeps_the_requests_own_constraint(client: openai.OpenAI) -> None:
    odd_tool: Any = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "x-guidance": 5}},
    }
    reply = _chat(
        client,
        tools=[WEATHER, odd_tool],
        tool_choice="none",
        max_tokens=5,
        temperature=0,
        extra_body={"guided_choice": ["yes", "no"]},
    ).choices[0]
    assert reply.message.content in ("yes", "no") and not reply.message.tool_calls
