"""POST /v1/responses through the official openai client over HTTP, on the default model.

Whole and streamed: the response object and its usage, instructions and developer messages, function
tools (with namespaces flattened and hosted tools dropped) round trips from function_call to
function_call_output, structured output, max_output_tokens clamped, a Codex-shaped body; server-held
state: a previous_response_id turn gives exactly the tokens chat completions gives for the whole
history and prefills only its new items; GET, DELETE and input_items.
"""

import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, suppress
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.errors import InvalidRequestError
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from kvserve.server.http.errors import APIError
from kvserve.server.http.tenants import Tenant, Tenants, load_or_create_secret
from kvserve.server.responses.convert import custom_arguments, custom_input
from kvserve.server.responses.protocol import ResponsesRequest
from kvserve.server.responses.serving import prepare
from tests.server.live import Server, assert_no_leak

NAME = "m"
MAX_MODEL_LEN = 1024
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 16}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


KEY_A = "key-of-tenant-a"
KEY_B = "key-of-tenant-b"


@pytest.fixture(scope="module")
def app(make_engine: Callable[..., Engine], tmp_path_factory: pytest.TempPathFactory) -> FastAPI:
    folder = tmp_path_factory.mktemp("responses-tenants")
    key_file = folder / "keys"
    key_file.write_text(f"a:{KEY_A}\nb:{KEY_B}\n")
    tenants = Tenants(load_or_create_secret(str(folder)), key_file=str(key_file))
    async_engine = AsyncEngine(make_engine(kv_cache_memory=64 * 2**20, max_model_len=MAX_MODEL_LEN))
    return create_app(async_engine, ServerOptions(served_model_name=NAME), tenants)


@pytest.fixture(scope="module")
def server(app: FastAPI, serve_app: Callable[[FastAPI], AbstractContextManager[str]]) -> Iterator[Server]:
    with serve_app(app) as url:
        yield Server(url, app.state.context.async_engine)


def _client(server: Server, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return _client(server)


def _create(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_output_tokens", 12)
    return client.responses.create(model=NAME, **kwargs)


def _streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[list[Any], Any]:
    """The stream's events and its final response."""
    events = list(_create(client, stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events, events[-1].response


def _shape(events: list[Any]) -> list[str]:
    """The events' types, a run of one type as one."""
    kinds = [e.type for e in events]
    return [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]


def test_a_plain_response_whole_and_streamed(client: openai.OpenAI, server: Server) -> None:
    whole = _create(client, input="Say hello.", instructions="Be brief.")
    assert whole.object == "response" and whole.id.startswith("resp_") and len(whole.id) > 40
    assert whole.status in ("completed", "incomplete")
    (message,) = whole.output
    assert message.type == "message" and message.role == "assistant"
    assert whole.output_text and whole.output_text == message.content[0].text
    assert whole.usage.output_tokens >= 1 and whole.usage.input_tokens > whole.usage.output_tokens
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    assert whole.instructions == "Be brief."
    events, final = _streamed(client, input="Say hello.", instructions="Be brief.")
    assert _shape(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{final.status}",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == final.output_text
    # The whole prompt was cached by the first request.
    assert final.usage.input_tokens_details.cached_tokens >= whole.usage.input_tokens - 16
    assert_no_leak(server.wait_idle())


def _tokenize(server: Server, messages: list[dict[str, Any]]) -> list[int]:
    reply = httpx.post(
        f"{server.url}/tokenize",
        json={"model": NAME, "messages": messages},
        headers={"Authorization": f"Bearer {KEY_A}"},
    )
    assert reply.status_code == 200, reply.text
    tokens: list[int] = reply.json()["tokens"]
    return tokens


def _prompt_ids(app: FastAPI, **body: Any) -> list[int]:
    """The prompt a Responses request of tenant a gets, from its plan."""
    ctx = app.state.context
    namespace = ctx.tenants.namespace(Tenant("a"))
    prepared = prepare(ctx, app.state.responses, ResponsesRequest(**body), namespace, "a")
    return list(prepared.plan.prompts[0].token_ids)


def test_previous_response_id_gives_chat_completions_tokens_and_prefills_only_the_new_items(
    client: openai.OpenAI, server: Server, app: FastAPI
) -> None:
    system = "Answer in one short sentence."
    questions = ["What is the capital of France?", "And of Italy?", "And of Spain?"]
    history: list[dict[str, Any]] = [{"role": "system", "content": system}]
    previous = None
    for stream in (False, True, False):
        question = questions.pop(0)
        kwargs: dict[str, Any] = {"input": question, "instructions": system, "max_output_tokens": 24}
        if previous is not None:
            kwargs["previous_response_id"] = previous.id
            # The plan continues from the stored ids: the prompt is the one chat encodes for the history.
            ids = _prompt_ids(app, **kwargs)
            assert ids == _tokenize(server, [*history, {"role": "user", "content": question}])
        turn = _streamed(client, **kwargs)[1] if stream else _create(client, **kwargs)
        history.append({"role": "user", "content": question})
        chat: Any = client.chat.completions.create(
            model=NAME,
            messages=history,  # type: ignore[arg-type]
            max_tokens=24,
            temperature=0,
        )
        assert turn.output_text == chat.choices[0].message.content
        assert turn.usage.input_tokens == chat.usage.prompt_tokens
        if previous is not None:
            # Only the new items were prefilled: the previous prompt and reply were all cached.
            before = previous.usage.input_tokens + previous.usage.output_tokens - 1
            assert before <= turn.usage.input_tokens_details.cached_tokens < turn.usage.input_tokens
        history.append({"role": "assistant", "content": turn.output_text})
        previous = turn
    assert_no_leak(server.wait_idle())


def test_instructions_are_not_carried_over(client: openai.OpenAI, app: FastAPI, server: Server) -> None:
    first = _create(client, input="Hi.", instructions="Reply in French.", max_output_tokens=4)
    ids = _prompt_ids(app, input="Bye.", previous_response_id=first.id)
    history = [
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Bye."},
    ]
    assert ids == _tokenize(server, history)


def test_function_call_round_trip_whole_and_streamed(client: openai.OpenAI, server: Server) -> None:
    ask = "What is the weather in Paris?"
    tools = [WEATHER]
    first = _create(
        client,
        input=ask,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=40,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events, streamed = _streamed(
        client,
        input=ask,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=40,
    )
    assert _shape(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    (streamed_call,) = streamed.output
    assert streamed_call.arguments == call.arguments
    assert "".join(e.delta for e in events if e.type.endswith("arguments.delta")) == call.arguments
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}
    second = _create(
        client,
        previous_response_id=first.id,
        input=[result],
        tools=tools,
        tool_choice="none",
        max_output_tokens=16,
    )
    assert second.output[0].type == "message" and second.output_text
    before = first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.input_tokens_details.cached_tokens >= before
    # The same conversation sent whole, as a stateless client sends it, gives the same answer.
    whole = [
        {"role": "user", "content": ask},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        result,
    ]
    stateless = _create(
        client, input=whole, tools=tools, tool_choice="none", max_output_tokens=16, store=False
    )
    assert stateless.output_text == second.output_text
    assert stateless.usage.input_tokens == second.usage.input_tokens
    assert_no_leak(server.wait_idle())


def test_structured_output(client: openai.OpenAI) -> None:
    text: Any = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    whole = _create(client, input="Describe a person.", text=text, max_output_tokens=60)
    jsonschema.validate(json.loads(whole.output_text), PERSON)
    assert whole.text.format.type == "json_schema"
    _, streamed = _streamed(client, input="Describe a person.", text=text, max_output_tokens=60)
    assert streamed.output_text == whole.output_text


def test_a_huge_max_output_tokens_is_clamped_to_the_room_left(client: openai.OpenAI, app: FastAPI) -> None:
    ctx = app.state.context
    namespace = ctx.tenants.namespace(Tenant("a"))
    plan = prepare(
        ctx, app.state.responses, ResponsesRequest(input="Hi.", max_output_tokens=2**62), namespace, "a"
    ).plan
    (prompt,) = plan.prompts
    assert prompt.checked.max_tokens == MAX_MODEL_LEN - len(prompt.token_ids)
    # Over HTTP too: a one-word schema ends the reply at once.
    yes: Any = {"format": {"type": "json_schema", "name": "yes", "schema": {"enum": ["yes"]}}}
    reply = _create(client, input="Hi.", max_output_tokens=2**62, text=yes)
    assert reply.output_text == '"yes"' and reply.max_output_tokens == 2**62


def test_get_delete_and_input_items(client: openai.OpenAI, server: Server) -> None:
    items: Any = [
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi."}]},
    ]
    made = _create(client, input=items, max_output_tokens=4, metadata={"k": "v"})
    got = client.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump() and got.metadata == {"k": "v"}
    listed = client.responses.input_items.list(made.id, order="asc")
    assert [i.role for i in listed.data] == ["developer", "user"]  # type: ignore[union-attr]
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        _create(client, input="Again.", previous_response_id=made.id)
    unstored = _create(client, input="Hi.", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_another_tenants_response_is_an_unknown_one(client: openai.OpenAI, server: Server) -> None:
    mine = _create(client, input="Secret plan: zebra-quorum.", max_output_tokens=2)
    other = _client(server, KEY_B)
    answers = []
    for response_id in (mine.id, "resp_" + "0" * 48):
        with pytest.raises(openai.NotFoundError) as found:
            other.responses.retrieve(response_id)
        answers.append(found.value.body)
        with pytest.raises(openai.NotFoundError):
            _create(other, input="Go on.", previous_response_id=response_id)
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(response_id)
        with pytest.raises(openai.NotFoundError):
            other.responses.input_items.list(response_id)
    # Told apart only by the id each names.
    unknown = "resp_" + "0" * 48
    assert json.dumps(answers[0]).replace(mine.id, unknown) == json.dumps(answers[1])
    assert "zebra-quorum" not in json.dumps(answers)
    assert client.responses.retrieve(mine.id).id == mine.id


def test_a_codex_shaped_body(server: Server) -> None:
    body = {
        "model": NAME,
        "instructions": "You are a coding agent.",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "Sandbox: none."}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "List the files."}],
            },
        ],
        "tools": [
            {**WEATHER, "strict": False},
            {"type": "web_search", "external_web_access": False},
            {
                "type": "namespace",
                "name": "mcp__fs",
                "description": "Files.",
                "tools": [
                    {
                        "type": "function",
                        "name": "list_files",
                        "description": "List files.",
                        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
                    },
                ],
            },
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199a1c3-5c2e-7a40-9b8e-3f1d2c4b5a69",
        "max_output_tokens": 30,
        "temperature": 0,
    }
    headers = {"Authorization": f"Bearer {KEY_A}"}
    for _ in range(2):
        with httpx.stream("POST", f"{server.url}/v1/responses", json=body, headers=headers, timeout=300) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        events = [json.loads(line[6:]) for line in lines]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        final = events[-1]["response"]
        assert final["status"] in ("completed", "incomplete") and final["store"] is False
        names = {i.get("name") for i in final["output"] if i["type"] == "function_call"}
        assert names <= {"get_weather", "list_files"}
    # The second run read the whole prompt from the cache.
    usage = final["usage"]
    assert usage["input_tokens_details"]["cached_tokens"] >= usage["input_tokens"] - 16
    assert httpx.get(f"{server.url}/v1/responses/{final['id']}", headers=headers).status_code == 404


EXEC = {"type": "custom", "name": "exec", "description": "Run a shell command.", "format": {"type": "text"}}


def test_a_custom_tool_round_trip(client: openai.OpenAI) -> None:
    """A custom tool is offered as a function of one string: its call comes back as a custom_tool_call
    with that string as its free-text input, whole and streamed, and a custom_tool_call_output answers it."""
    forced: Any = {"type": "custom", "name": "exec"}
    whole = _create(client, input="List the files.", tools=[EXEC], tool_choice=forced, max_output_tokens=48)
    (call,) = whole.output
    assert call.type == "custom_tool_call" and call.name == "exec" and call.call_id
    assert isinstance(call.input, str)
    events, final = _streamed(
        client, input="List the files.", tools=[EXEC], tool_choice=forced, max_output_tokens=48
    )
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" not in kinds
    done = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    (streamed,) = final.output
    assert streamed.type == "custom_tool_call" and [e.input for e in done] == [streamed.input]
    answered = _create(
        client,
        input=[
            _message("List the files."),
            {"type": "custom_tool_call", "call_id": call.call_id, "name": "exec", "input": call.input},
            {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "notes.txt"},
        ],
        tools=[EXEC],
    )
    assert answered.status in ("completed", "incomplete")


@given(st.text())
def test_a_custom_tool_input_is_the_string_of_the_arguments_it_is_offered_as(text: str) -> None:
    assert custom_input(custom_arguments(text)) == text
    # Arguments that are not {"input": string} (a reply cut short) are the input as they stand.
    assert custom_input('{"input": "cut') == '{"input": "cut'


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def _message(text: str, role: str = "user") -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}


# (what, body or raw bytes, status, the param the error names or None)
HOSTILE: list[tuple[str, Any, int, str | None]] = [
    (
        "unknown previous_response_id",
        {"input": "Hi", "previous_response_id": "resp_x"},
        404,
        "previous_response_id",
    ),
    (
        "function_call_output of an unknown call",
        {"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]},
        400,
        "input[0].call_id",
    ),
    ("huge item list", {"input": [_message("x")] * 3000}, 400, "input"),
    ("deep content", f'{{"input": [{{"role": "user", "content": {_deep(20_000)}}}]}}'.encode(), 400, None),
    ("deep input", f'{{"input": {_deep(50_000)}}}'.encode(), 400, None),
    ("negative max_output_tokens", {"input": "Hi", "max_output_tokens": -5}, 400, "max_output_tokens"),
    ("negative max_output_tokens", {"input": "Hi", "max_output_tokens": -1}, 400, "max_output_tokens"),
    ("role tool", {"input": [{"role": "tool", "content": "x"}]}, 400, "input[0].role"),
    ("role function", {"input": [_message("x", "function")]}, 400, "input[0].role"),
    (
        "an image part",
        {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
        400,
        "input[0].content[0]",
    ),
    ("an item reference", {"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0]"),
    (
        "a call without arguments",
        {"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
        400,
        None,
    ),
    ("no type, no role", {"input": [{"content": "x"}]}, 400, "input[0]"),
    ("empty input", {"input": []}, 400, "input"),
    ("input over the context", {"input": "word " * 5000}, 400, "input"),
    ("a hosted tool_choice", {"input": "Hi", "tool_choice": {"type": "web_search"}}, 400, "tool_choice"),
    (
        "a nested namespace",
        {"input": "Hi", "tools": [{"type": "namespace", "tools": [{"type": "namespace"}]}]},
        400,
        None,
    ),
    ("a tool without a type", {"input": "Hi", "tools": [{"name": "f"}]}, 400, "tools[0]"),
    ("too much metadata", {"input": "Hi", "metadata": {str(i): "v" for i in range(17)}}, 400, "metadata"),
    ("an unknown text format", {"input": "Hi", "text": {"format": {"type": "xml"}}}, 400, "text.format"),
    ("an unknown model", {"input": "Hi", "model": "gpt-9"}, 404, "model"),
    (
        "additional_tools with a tool without a name",
        {"input": [{"type": "additional_tools", "tools": [{"type": "function"}]}, _message("Hi")]},
        400,
        "input[0].tools[0]",
    ),
    (
        "additional_tools with a tool without a type",
        {"input": [{"type": "additional_tools", "tools": ["exec"]}, _message("Hi")]},
        400,
        "input[0].tools[0]",
    ),
    ("additional_tools without tools", {"input": [{"type": "additional_tools"}]}, 400, "input[0]"),
    (
        "additional_tools over the tool bound",
        {"input": [{"type": "additional_tools", "tools": [WEATHER] * 300}, _message("Hi")]},
        400,
        None,
    ),
    ("a custom tool without a name", {"input": "Hi", "tools": [{"type": "custom"}]}, 400, "tools[0]"),
    (
        "custom_tool_call_output of an unknown call",
        {"input": [{"type": "custom_tool_call_output", "call_id": "call_nope", "output": "x"}]},
        400,
        "input[0].call_id",
    ),
    (
        "a custom_tool_call without input",
        {"input": [{"type": "custom_tool_call", "call_id": "c", "name": "exec"}]},
        400,
        "input[0].input",
    ),
    (
        "a huge custom tool input",
        {
            "input": [
                {"type": "custom_tool_call", "call_id": "c", "name": "exec", "input": "word " * 5000},
                {"type": "custom_tool_call_output", "call_id": "c", "output": "done"},
            ],
            "tools": [{"type": "custom", "name": "exec"}],
        },
        400,
        "input",
    ),
]


@pytest.mark.parametrize(("what", "body", "status", "param"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_input_is_a_clear_4xx(
    server: Server, what: str, body: Any, status: int, param: str | None
) -> None:
    headers = {"Authorization": f"Bearer {KEY_A}", "Content-Type": "application/json"}
    if isinstance(body, bytes):
        reply = httpx.post(f"{server.url}/v1/responses", content=body, headers=headers, timeout=120)
    else:
        reply = httpx.post(
            f"{server.url}/v1/responses", json={"model": NAME, **body}, headers=headers, timeout=120
        )
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in reply.text and len(reply.text) < 2000
    if param is not None:
        assert error["param"] == param, error


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(max_output_tokens=st.integers(min_value=-(2**63), max_value=2**63))
def test_any_max_output_tokens_is_refused_or_clamped(app: FastAPI, max_output_tokens: int) -> None:
    ctx = app.state.context
    namespace = ctx.tenants.namespace(Tenant("a"))
    body = ResponsesRequest(input="Hi.", max_output_tokens=max_output_tokens)
    if max_output_tokens < 0:
        with pytest.raises(InvalidRequestError):
            prepare(ctx, app.state.responses, body, namespace, "a")
        return
    (prompt,) = prepare(ctx, app.state.responses, body, namespace, "a").plan.prompts
    assert prompt.checked.max_tokens == min(max_output_tokens, MAX_MODEL_LEN - len(prompt.token_ids))


_TEXT = st.text(max_size=20)
_PART = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "input_image", "x"])}, optional={"text": _TEXT}
)
_ITEM = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "other"]),
        "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
        "content": st.one_of(_TEXT, st.lists(_PART, max_size=3)),
        "call_id": st.sampled_from(["c1", "c2"]),
        "name": st.sampled_from(["get_weather", "f"]),
        "arguments": st.sampled_from(['{"city": "Rome"}', "{", ""]),
        "output": _TEXT,
    },
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(items=st.lists(_ITEM, max_size=6))
def test_any_item_list_is_planned_or_refused_by_name(app: FastAPI, items: list[dict[str, Any]]) -> None:
    ctx = app.state.context
    namespace = ctx.tenants.namespace(Tenant("a"))
    try:
        body = ResponsesRequest.model_validate({"input": items, "tools": [WEATHER]})
    except ValidationError:
        return
    with suppress(InvalidRequestError, APIError):
        prepare(ctx, app.state.responses, body, namespace, "a")
