"""Anthropic's Messages API over HTTP, through the official `anthropic` client, on the default model.

Whole and streamed messages (the event sequence, pings); usage in Anthropic's three parts, which add up
to the prompt that count_tokens counts, with a multi-turn chat's cache hits in cache_read_input_tokens
and the breakpoints' new prefix in cache_creation_input_tokens; a tool_use -> tool_result round trip
whose second turn reads the first turn's KV through the call; output_config.format; stop sequences;
max_tokens clamped to the context; x-api-key with tenants; thinking on a reasoning template; a body
shaped like Claude Code's; and hostile input, each a 4xx in Anthropic's shape with no block left locked.
"""

import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.options import ServerOptions
from kvserve.server.anthropic import serving as anthropic_serving
from kvserve.server.anthropic.protocol import MAX_MAX_TOKENS
from kvserve.server.app import create_app
from kvserve.server.http.tenants import Tenants, load_or_create_secret
from tests.server import chat_templates
from tests.server.live import Server, assert_no_leak

NAME = "m"
MAX_MODEL_LEN = 1024
BLOCK = 16
WEATHER: Any = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 8
# The current SDK has no temperature argument; the API still takes one.
GREEDY = {"temperature": 0}
KEYS = {"alice": "key-alice-aaaa", "bob": "key-bob-bbbbbb"}


@pytest.fixture(scope="module")
def server(
    make_engine: Callable[..., Engine], serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[Server]:
    async_engine = AsyncEngine(make_engine(kv_cache_memory=64 * 2**20, max_model_len=MAX_MODEL_LEN))
    with serve_app(create_app(async_engine, ServerOptions(served_model_name=NAME))) as url:
        yield Server(url, async_engine)


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def _usage_total(usage: Any) -> int:
    return int(usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens)


def _n(value: int | None) -> int:
    assert value is not None
    return value


def _count(client: anthropic.Anthropic, **kwargs: Any) -> int:
    return client.messages.count_tokens(model=NAME, **kwargs).input_tokens


def test_a_message_whole_and_streamed_with_the_event_sequence(
    server: Server, client: anthropic.Anthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    ask: Any = [{"role": "user", "content": "Name three colours."}]
    whole = client.messages.create(model=NAME, max_tokens=12, messages=ask, extra_body=GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == NAME
    assert whole.stop_reason in ("end_turn", "max_tokens")
    (block,) = whole.content
    assert block.type == "text" and block.text
    assert whole.usage.output_tokens <= 12
    assert _usage_total(whole.usage) == _count(client, messages=ask)
    with client.messages.stream(model=NAME, max_tokens=12, messages=ask, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    # The raw events (the client keeps pings to itself): a ping after message_start, and another
    # whenever no delta came for the interval. An interval of 0 pings whenever the reader has caught up
    # with the engine, which it does between tokens: 10 ms failed in CI, whose tokens came faster.
    monkeypatch.setattr(anthropic_serving, "PING_INTERVAL_S", 0.0)
    body = {"model": NAME, "max_tokens": 12, "messages": ask, "stream": True, **GREEDY}
    events = _sse_events(httpx.post(f"{server.url}/v1/messages", json=body, timeout=300).text)
    kinds = [k for k, _ in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("ping") > 1
    assert [k for k in kinds if k.startswith("content_block")] == [
        "content_block_start",
        *["content_block_delta"] * (kinds.count("content_block_delta")),
        "content_block_stop",
    ]
    text = "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta")
    assert text == block.text
    assert streamed.content[0].text == block.text  # type: ignore[union-attr]
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert_no_leak(server.wait_idle())


def test_multi_turn_cache_hits_are_read_and_a_breakpoint_creates(client: anthropic.Anthropic) -> None:
    system: Any = [{"type": "text", "text": "Turn test. " + SYSTEM, "cache_control": {"type": "ephemeral"}}]
    first: Any = [{"role": "user", "content": "Say hello."}]
    one = client.messages.create(model=NAME, max_tokens=10, system=system, messages=first, extra_body=GREEDY)
    prompt_one = _count(client, system=system, messages=first)
    assert _usage_total(one.usage) == prompt_one
    # Nothing of it was cached before but the template's opening, which every prompt shares; the system
    # prompt up to its breakpoint is newly cached.
    assert _n(one.usage.cache_read_input_tokens) < 8
    assert 0 < _n(one.usage.cache_creation_input_tokens) < prompt_one
    reply: Any = [{"type": "text", "text": one.content[0].text}]  # type: ignore[union-attr]
    second: Any = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "Again."}]
    two = client.messages.create(model=NAME, max_tokens=10, system=system, messages=second, extra_body=GREEDY)
    assert _usage_total(two.usage) == _count(client, system=system, messages=second)
    # The whole first turn, reply included, is read from the cache (whole blocks of it).
    assert _n(two.usage.cache_read_input_tokens) >= prompt_one + one.usage.output_tokens - 1 - BLOCK
    assert _n(two.usage.cache_creation_input_tokens) == 0
    # The top-level cache_control marks the last block: its retention keeps the prompt's whole blocks, so
    # what is neither read nor kept is less than a block, and the markup after the breakpoint.
    third: Any = [*second[:-1], {"role": "user", "content": "Once more, please."}]
    three = client.messages.create(
        model=NAME,
        max_tokens=4,
        system=system,
        messages=third,
        extra_body=GREEDY,
        cache_control={"type": "ephemeral"},
    )
    assert _n(three.usage.cache_read_input_tokens) > 0
    assert 0 < _n(three.usage.input_tokens) < BLOCK + 8


def test_a_tool_use_and_its_result_round_trip_through_the_cache(
    server: Server, client: anthropic.Anthropic
) -> None:
    ask: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    for stream in (False, True):
        kwargs: Any = {
            "model": NAME,
            "max_tokens": 40,
            "messages": ask,
            "tools": [WEATHER],
            "extra_body": GREEDY,
        }
        if stream:
            deltas: list[str] = []
            with client.messages.stream(
                **kwargs, tool_choice={"type": "any", "disable_parallel_tool_use": True}
            ) as events:
                for event in events:
                    if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                        deltas.append(event.delta.partial_json)
                call = events.get_final_message()
            assert json.loads("".join(deltas)) == call.content[0].input  # type: ignore[union-attr]
        else:
            call = client.messages.create(
                **kwargs, tool_choice={"type": "any", "disable_parallel_tool_use": True}
            )
        assert call.stop_reason == "tool_use"
        (use,) = call.content
        assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
        jsonschema.validate(use.input, WEATHER["input_schema"])
        prompt_one = _count(client, messages=ask, tools=[WEATHER])
        history: Any = [
            *ask,
            {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C."}],
            },
        ]
        answer = client.messages.create(
            model=NAME,
            max_tokens=12,
            messages=history,
            tools=[WEATHER],
            tool_choice={"type": "none"},
            extra_body=GREEDY,
        )
        assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
        # The call comes back as the text the model wrote: the second turn reads the first one's KV
        # through the call, to its last token (whose KV was never computed) at most.
        read = _n(answer.usage.cache_read_input_tokens)
        assert read >= prompt_one + call.usage.output_tokens - 2, (read, prompt_one, call.usage.output_tokens)
    assert_no_leak(server.wait_idle())


def test_a_named_tool_choice_and_a_text_reply_under_auto(client: anthropic.Anthropic) -> None:
    ask: Any = [{"role": "user", "content": "Weather in Oslo?"}]
    named = client.messages.create(
        model=NAME,
        max_tokens=40,
        messages=ask,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )
    assert [b.type for b in named.content] == ["tool_use"] and named.stop_reason == "tool_use"


def test_output_config_format_constrains_the_reply(client: anthropic.Anthropic) -> None:
    ask: Any = [{"role": "user", "content": "Describe a fictional person."}]
    fmt: Any = {"format": {"type": "json_schema", "schema": PERSON}, "effort": "high"}
    whole = client.messages.create(
        model=NAME, max_tokens=60, messages=ask, output_config=fmt, extra_body=GREEDY
    )
    assert whole.stop_reason == "end_turn"
    jsonschema.validate(json.loads(whole.content[0].text), PERSON)  # type: ignore[union-attr]
    with client.messages.stream(
        model=NAME, max_tokens=60, messages=ask, output_config=fmt, extra_body=GREEDY
    ) as s:
        text = "".join(s.text_stream)
    assert text == whole.content[0].text  # type: ignore[union-attr]


def test_a_stop_sequence_is_named(client: anthropic.Anthropic) -> None:
    ask: Any = [{"role": "user", "content": "Count from one to ten in words, separated by commas."}]
    free = client.messages.create(model=NAME, max_tokens=30, messages=ask, extra_body=GREEDY)
    text = free.content[0].text  # type: ignore[union-attr]
    middle = len(text) // 2
    stop = text[middle : middle + 3]
    assert len(stop) == 3, text
    cut = client.messages.create(
        model=NAME, max_tokens=30, messages=ask, extra_body=GREEDY, stop_sequences=[stop]
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert stop not in cut.content[0].text  # type: ignore[union-attr]


def test_max_tokens_is_clamped_to_the_room_left(client: anthropic.Anthropic) -> None:
    """Claude Code asks for 32,000 tokens from any model: the reply gets what the context leaves."""
    filler = "word " * 900
    ask: Any = [{"role": "user", "content": filler}]
    room = MAX_MODEL_LEN - _count(client, messages=ask)
    assert 1 <= room < 200
    reply = client.messages.create(model=NAME, max_tokens=32000, messages=ask, extra_body=GREEDY)
    assert reply.usage.output_tokens <= room


def test_a_prompt_over_the_context_and_an_unknown_model_in_anthropics_shape(
    client: anthropic.Anthropic,
) -> None:
    over: Any = [{"role": "user", "content": "word " * 2000}]
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=NAME, max_tokens=10, messages=over)
    body: Any = bad.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "context length" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=10, messages=over)
    body = missing.value.body
    assert body["error"]["type"] == "not_found_error" and "claude-sonnet-4-5" in body["error"]["message"]


def _sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for chunk in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        events.append((lines["event"], data))
    return events


def _tool(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    return {"name": name, "description": f"The {name} tool. " * 6, "input_schema": schema}


def test_a_body_shaped_like_claude_codes(server: Server) -> None:
    """What Claude Code 2.1 posts: `?beta=true`, its headers, stream, max_tokens 32000, three system
    blocks (two with cache_control), a system-role message, tools, adaptive thinking,
    context_management, output_config.effort and metadata.user_id."""
    tools = [
        _tool("Bash", {"command": {"type": "string"}, "timeout": {"type": "number"}}),
        _tool("Read", {"file_path": {"type": "string"}, "offset": {"type": "integer"}}),
        _tool("Edit", {"file_path": {"type": "string"}, "old_string": {"type": "string"}}),
        _tool("Grep", {"pattern": {"type": "string"}, "path": {"type": "string"}}),
    ]
    body: dict[str, Any] = {
        "model": NAME,
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "system", "content": "The working directory is /tmp/project."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>Be brief.</system-reminder>"},
                    {"type": "text", "text": "List the files.", "cache_control": {"type": "ephemeral"}},
                ],
            },
        ],
        "tools": tools,
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": "user_abc_account_def_session_0123"},
    }
    headers = {
        "x-api-key": "unused",
        "anthropic-version": "2023-06-01",
        "anthropic-beta": ",".join(
            ["claude-code-20250219", "interleaved-thinking-2025-05-14", "context-management-2025-06-27"]
        ),
    }
    count = httpx.post(
        f"{server.url}/v1/messages/count_tokens?beta=true", json=body, headers=headers, timeout=60
    )
    assert count.status_code == 200, count.text
    # Filler in the system-role message leaves a short reply's room, so that the clamped max_tokens
    # ends it soon.
    room = MAX_MODEL_LEN - count.json()["input_tokens"]
    body["messages"][0]["content"] += " ok" * (room - 24)
    r = httpx.post(f"{server.url}/v1/messages?beta=true", json=body, headers=headers, timeout=300)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = _sse_events(r.text)
    kinds = [k for k, _ in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    usage = events[-2][1]["usage"]
    assert events[-2][1]["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
    assert (
        prompt
        == httpx.post(
            f"{server.url}/v1/messages/count_tokens", json=body, headers=headers, timeout=60
        ).json()["input_tokens"]
    )
    # Three breakpoints: the last (the user's text) is near the prompt's end, past the tenant's retention
    # budget, so what it kept is the budget: the prompt's first blocks.
    budget = server.call(lambda e: e.kv.retainable_length(prompt))
    assert budget < prompt - 16
    assert usage["cache_creation_input_tokens"] == budget - usage["cache_read_input_tokens"]
    assert_no_leak(server.wait_idle())


@pytest.fixture(scope="module")
def keyed(
    tmp_path_factory: pytest.TempPathFactory,
    make_engine: Callable[..., Engine],
    serve_app: Callable[[FastAPI], AbstractContextManager[str]],
) -> Iterator[str]:
    folder: Path = tmp_path_factory.mktemp("anthropic-keys")
    (folder / "keys").write_text("".join(f"{t}:{k}\n" for t, k in KEYS.items()))
    tenants = Tenants(load_or_create_secret(str(folder)), key_file=str(folder / "keys"))
    engine = AsyncEngine(make_engine(kv_cache_memory=32 * 2**20, max_model_len=MAX_MODEL_LEN))
    with serve_app(create_app(engine, ServerOptions(served_model_name=NAME), tenants)) as url:
        yield url


def test_x_api_key_names_the_tenant_whose_cache_it_reads(keyed: str) -> None:
    """Claude Code sends its key as x-api-key; the current SDK sends it as a bearer token."""
    ask: Any = [{"role": "user", "content": SYSTEM + "Tenant check."}]
    body = {"model": NAME, "max_tokens": 2, "messages": ask, **GREEDY}

    def post(key: str) -> httpx.Response:
        return httpx.post(f"{keyed}/v1/messages", json=body, headers={"x-api-key": key}, timeout=300)

    def read(key: str) -> int:
        r = post(key)
        assert r.status_code == 200, r.text
        tokens: int = r.json()["usage"]["cache_read_input_tokens"]
        return tokens

    assert read(KEYS["alice"]) < 8
    assert read(KEYS["alice"]) > 8
    # Another tenant's identical prompt finds nothing of alice's.
    assert read(KEYS["bob"]) < 8
    # The bearer header (the SDK's) names the same tenant as x-api-key.
    sdk = anthropic.Anthropic(base_url=keyed, api_key=KEYS["bob"], max_retries=0, timeout=300)
    usage = sdk.messages.create(model=NAME, max_tokens=2, messages=ask, extra_body=GREEDY).usage
    assert _n(usage.cache_read_input_tokens) > 8
    denied = post("key-nobody-zzzz")
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"


def test_thinking_sets_a_reasoning_templates_switch(
    make_engine: Callable[..., Engine],
    serve_app: Callable[[FastAPI], AbstractContextManager[str]],
    tmp_path: Path,
) -> None:
    """On a reasoning template, thinking enabled or adaptive leaves the template's think block to the
    model and disabled closes it in the prompt; on one without, thinking changes nothing."""
    path = tmp_path / "qwen3.jinja"
    path.write_text(chat_templates.QWEN3)
    engine = AsyncEngine(make_engine(kv_cache_memory=16 * 2**20, max_model_len=MAX_MODEL_LEN))
    with serve_app(create_app(engine, ServerOptions(served_model_name=NAME, chat_template=str(path)))) as url:
        c = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300)
        ask: Any = [{"role": "user", "content": "Hi."}]
        on = _count(c, messages=ask, thinking={"type": "adaptive"})
        assert _count(c, messages=ask, thinking={"type": "enabled", "budget_tokens": 2048}) == on
        assert _count(c, messages=ask, thinking={"type": "disabled"}) == _count(c, messages=ask) > on


def test_a_reasoning_reply_becomes_a_thinking_block_and_streams_first() -> None:
    from kvserve.engine.outputs import PromptOutputs, RequestDelta
    from kvserve.server.anthropic.serving import MessagesFormat, _ReplyStream
    from kvserve.server.core.output import Choice

    text = "<think>\nthe user greets\n</think>\n\nHello there."
    fmt = MessagesFormat(None, None, None, True, False, ())  # type: ignore[arg-type]
    outputs = PromptOutputs.start(3, 1)
    outputs.add(0, RequestDelta("r", [1], text, True, "stop", 3, 0, 1))
    blocks, calls = fmt.content(Choice(0, None, outputs, 0))  # type: ignore[arg-type]
    assert not calls
    assert blocks == [
        {"type": "thinking", "thinking": "the user greets", "signature": ""},
        {"type": "text", "text": "Hello there."},
    ]
    reply = _ReplyStream(fmt)
    events = [e for i in range(0, len(text), 5) for e in reply.push(text[i : i + 5], i + 5 >= len(text))]
    events += reply.end()
    parsed = [json.loads(e.split("data: ", 1)[1]) for e in events]
    thinking = "".join(p["delta"].get("thinking", "") for p in parsed if p["type"] == "content_block_delta")
    said = "".join(p["delta"].get("text", "") for p in parsed if p["type"] == "content_block_delta")
    assert (thinking, said) == ("the user greets", "Hello there.")
    starts = [p["content_block"]["type"] for p in parsed if p["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    assert [p["type"] for p in parsed].count("content_block_stop") == 2


def _post(server: Server, body: Any, path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def _assert_anthropic_refusal(r: httpx.Response, status: int = 400) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["message"]
    assert "Traceback" not in r.text
    message: str = body["error"]["message"]
    return message


USER: Any = {"role": "user", "content": "Hi."}
CALL: Any = {
    "role": "assistant",
    "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}],
}
HOSTILE: list[tuple[str, dict[str, Any], str]] = [
    (
        "a tool_result answering no tool_use",
        {
            "messages": [
                USER,
                CALL,
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2"}]},
            ]
        },
        "toolu_2",
    ),
    (
        "a tool_result with no tool_use before it",
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}]},
        "tool_use",
    ),
    (
        "an image block",
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "'image'",
    ),
    (
        "a document block",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "document"}]}]},
        "'document'",
    ),
    (
        "an image inside a tool result",
        {
            "messages": [
                USER,
                CALL,
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "image"}]}
                    ],
                },
            ]
        },
        "'image'",
    ),
    (
        "a huge block list",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 300}]},
        "256",
    ),
    ("too many messages", {"messages": [USER] * 3000}, "2048"),
    (
        "a bad cache_control ttl",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "a", "cache_control": {"type": "ephemeral", "ttl": "10m"}}
                    ],
                }
            ]
        },
        "ttl",
    ),
    (
        "a cache_control that is not ephemeral",
        {"messages": [USER], "cache_control": {"type": "persistent"}},
        "ephemeral",
    ),
    (
        "five breakpoints",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}] * 5,
                }
            ]
        },
        "at most 4",
    ),
    ("a negative max_tokens", {"messages": [USER], "max_tokens": -1}, "max_tokens"),
    ("a huge max_tokens", {"messages": [USER], "max_tokens": 10**12}, "max_tokens"),
    ("a tool role", {"messages": [{"role": "tool", "content": "x"}]}, "role"),
    ("a tool_use in a user turn", {"messages": [{**CALL, "role": "user"}]}, "user turn"),
    (
        "a tool_result in an assistant turn",
        {"messages": [USER, {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
        "assistant turn",
    ),
    ("an assistant turn last", {"messages": [USER, {"role": "assistant", "content": "Sure"}]}, "prefill"),
    (
        "an assistant turn last but for a system turn",
        {"messages": [USER, {"role": "assistant", "content": "Sure"}, {"role": "system", "content": "x"}]},
        "prefill",
    ),
    ("system turns alone", {"messages": [{"role": "system", "content": "x"}]}, "user turn"),
    (
        "a server tool",
        {"messages": [USER], "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        "only Anthropic",
    ),
    (
        "a tool_choice naming no tool",
        {"messages": [USER], "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
        "tool_choice",
    ),
    (
        "an unknown tool_choice",
        {"messages": [USER], "tools": [WEATHER], "tool_choice": {"type": "some"}},
        "tool_choice",
    ),
    ("an unknown thinking type", {"messages": [USER], "thinking": {"type": "deep"}}, "thinking"),
    (
        "a bad output format",
        {"messages": [USER], "output_config": {"format": {"type": "regex"}}},
        "output_config",
    ),
    (
        "tools with an output format",
        {
            "messages": [USER],
            "tools": [WEATHER],
            "output_config": {"format": {"type": "json_schema", "schema": PERSON}},
        },
        "tools",
    ),
    ("a temperature out of range", {"messages": [USER], "temperature": 1000}, "temperature"),
    ("no messages", {"messages": []}, "messages"),
]


@pytest.mark.parametrize("body, says", [(b, s) for _, b, s in HOSTILE], ids=[w for w, _, _ in HOSTILE])
def test_hostile_input_is_a_clear_4xx_in_anthropics_shape(
    server: Server, body: dict[str, Any], says: str
) -> None:
    message = _assert_anthropic_refusal(_post(server, {"model": NAME, "max_tokens": 8, **body}))
    assert says in message
    assert_no_leak(server.wait_idle())


@pytest.mark.parametrize("depth", [100, 5000])
def test_a_deep_tool_input_is_refused_or_read(server: Server, depth: int) -> None:
    """Written by hand: no JSON library here writes 5,000 levels."""
    deep = '{"a":' * depth + "{}" + "}" * depth
    use = f'{{"type":"tool_use","id":"toolu_1","name":"get_weather","input":{deep}}}'
    body = (
        f'{{"model":"{NAME}","max_tokens":8,"messages":[{{"role":"user","content":"Hi."}},'
        f'{{"role":"assistant","content":[{use}]}},{{"role":"user","content":"Hi."}}]}}'
    )
    r = httpx.post(
        f"{server.url}/v1/messages/count_tokens",
        content=body.encode(),
        headers={"content-type": "application/json"},
        timeout=120,
    )
    if depth == 100:
        assert r.status_code == 200, r.text
    else:
        _assert_anthropic_refusal(r)
    assert_no_leak(server.wait_idle())


def test_every_error_on_these_routes_is_in_anthropics_shape(server: Server) -> None:
    assert "not valid JSON" in _assert_anthropic_refusal(
        httpx.post(f"{server.url}/v1/messages", content=b"{", headers={"content-type": "application/json"})
    )
    _assert_anthropic_refusal(_post(server, {"model": NAME, "messages": [USER]}))
    _assert_anthropic_refusal(
        _post(server, {"messages": [USER], "model": "nope"}, "/v1/messages/count_tokens"), 404
    )
    _assert_anthropic_refusal(httpx.get(f"{server.url}/v1/messages"), 405)
    # Other routes keep OpenAI's shape.
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []})
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@given(ttl=st.text(max_size=8))
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_a_breakpoints_ttl_is_5m_or_1h(server: Server, ttl: str) -> None:
    block = {"type": "text", "text": "a", "cache_control": {"type": "ephemeral", "ttl": ttl}}
    r = _post(
        server,
        {"model": NAME, "messages": [{"role": "user", "content": [block]}]},
        "/v1/messages/count_tokens",
    )
    if ttl in ("5m", "1h"):
        assert r.status_code == 200, r.text
    else:
        assert "ttl" in _assert_anthropic_refusal(r)


@given(
    max_tokens=st.one_of(
        st.integers(-(2**70), 2**70), st.integers(-2, 40), st.integers(MAX_MAX_TOKENS - 2, MAX_MAX_TOKENS + 2)
    )
)
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_max_tokens_in_range_is_served_and_outside_it_refused(server: Server, max_tokens: int) -> None:
    # A one-word schema ends every reply in a few tokens, whatever max_tokens allows.
    body = {
        "model": NAME,
        "max_tokens": max_tokens,
        "messages": [USER],
        "output_config": {"format": {"type": "json_schema", "schema": {"enum": ["yes", "no"]}}},
    }
    r = _post(server, body)
    if 0 <= max_tokens <= MAX_MAX_TOKENS:
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["output_tokens"] <= max_tokens
        # 0 is a pre-warm: no content at all.
        assert bool(r.json()["content"]) == (max_tokens > 0)
    else:
        assert "max_tokens" in _assert_anthropic_refusal(r)
    assert_no_leak(server.wait_idle())
