"""The review's probe of stored responses, over HTTP on a real server: a body whose tools, tool_choice
and additional_tools item carry junk fields (and hosted tools carrying junk) stores only what the server
acts on, so the memory held after such responses is a few KiB where the junk, kept as Python objects,
was tens of MB (tracemalloc around them). A GET answers the very bytes the POST answered, whole or
streamed, without parsing or writing a response on the event loop."""

import gc
import json
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from kvserve.server.responses.protocol import ResponseObject
from kvserve.server.responses.store import Replay
from tests.server.live import Server, assert_no_leak

NAME = "m"
# 16,000 dicts (over 1 MB once parsed) in each of the body's seven junk fields: 112,000 containers, within
# the server's bound on one body (json_body.JSONBounds, 2**17).
JUNK: list[dict[str, Any]] = [{}] * 16_000
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": PARAMETERS,
}
LIST_FILES = {"type": "function", "name": "list_files", "parameters": {"type": "object", "properties": {}}}
READ_FILE = {"type": "function", "name": "read_file", "parameters": {"type": "object", "properties": {}}}
EXEC = {"type": "custom", "name": "exec", "description": "Run a command."}


def _body(junk: list[Any]) -> dict[str, Any]:
    grammar = {"type": "grammar", "syntax": "lark", "definition": "start: " + '"x" ' * (len(junk) // 8)}
    return {
        "model": NAME,
        "input": [
            {
                "type": "additional_tools",
                "tools": [{**READ_FILE, "junk": junk}, {"type": "mcp", "junk": junk}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Weather in Rome?"}],
            },
        ],
        "tools": [
            {**WEATHER, "junk": junk, "defer_loading": True},
            {"type": "web_search", "junk": junk},
            {
                "type": "namespace",
                "name": "fs",
                "description": "Files.",
                "tools": [{**LIST_FILES, "junk": junk}, {"type": "file_search", "junk": junk}],
            },
            {**EXEC, "format": grammar},
        ],
        "tool_choice": {"type": "function", "name": "get_weather", "junk": junk},
        "max_output_tokens": 6,
        "temperature": 0,
    }


@pytest.fixture(scope="module")
def server(
    make_engine: Callable[..., Engine], serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[Server]:
    async_engine = AsyncEngine(make_engine(kv_cache_memory=64 * 2**20, max_model_len=1024))
    with serve_app(create_app(async_engine, ServerOptions(served_model_name=NAME))) as url:
        yield Server(url, async_engine)


def _post(url: str, body: dict[str, Any]) -> bytes:
    reply = httpx.post(f"{url}/v1/responses", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.content


def _streamed(url: str, body: dict[str, Any]) -> str:
    """The data line of the stream's last event."""
    with httpx.stream("POST", f"{url}/v1/responses", json={**body, "stream": True}, timeout=300) as reply:
        assert reply.status_code == 200
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    return lines[-1][len("data: ") :]


def _get(url: str, response_id: str, what: str = "") -> bytes:
    reply = httpx.get(f"{url}/v1/responses/{response_id}{what}", timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.content


def _held_by_a_pair(url: str, junk: list[Any]) -> tuple[int, bytes, dict[str, Any]]:
    """Bytes still held (tracemalloc, the whole process) after one stored response whole and one
    streamed, and their replies."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        whole = _post(url, _body(junk))
        final = json.loads(_streamed(url, _body(junk)))["response"]
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before, whole, final
    finally:
        tracemalloc.stop()


def test_junk_is_neither_echoed_nor_stored_nor_held(server: Server) -> None:
    # Warm (grammars compiled, prompt cached, both paths run once), then the same pair without junk as
    # the control: the process holds other things too, and only the difference is the junk's.
    _held_by_a_pair(server.url, [])
    control, _, _ = _held_by_a_pair(server.url, [])
    # The least of two: what other threads of a full run allocate meanwhile only adds to a measure.
    held, whole, final = _held_by_a_pair(server.url, JUNK)
    held = min(held, _held_by_a_pair(server.url, JUNK)[0]) - control
    # Before: the junk was kept as parsed objects in response.tools, tool_choice and the input items,
    # about 50 MB a response.
    assert held < 2 * 2**20, held
    for response in (json.loads(whole), final):
        assert response["tools"] == [
            WEATHER,
            {"type": "namespace", "name": "fs", "description": "Files.", "tools": [LIST_FILES]},
            EXEC,
        ]
        assert response["tool_choice"] == {"type": "function", "name": "get_weather"}
        stored = [_get(server.url, response["id"]), _get(server.url, response["id"], "/input_items")]
        assert not any(b"junk" in data or b"grammar" in data for data in stored)
        (tools_item,) = [i for i in json.loads(stored[1])["data"] if i["type"] == "additional_tools"]
        assert tools_item["tools"] == [READ_FILE]
    assert_no_leak(server.wait_idle())


def test_a_get_answers_the_bytes_the_post_answered(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    body = {"model": NAME, "input": "Grüße, wie geht's?", "max_output_tokens": 8, "metadata": {"k": "v"}}
    whole = _post(server.url, body)
    streamed = _streamed(server.url, body)
    streamed_id = json.loads(streamed)["response"]["id"]

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a GET parses or writes no response")

    # A GET sends what it holds: no response object is made, written or read on its way.
    for name in ("model_dump_json", "model_dump", "model_validate_json"):
        monkeypatch.setattr(ResponseObject, name, refused)
    monkeypatch.setattr(Replay, "model_validate_json", refused)
    assert _get(server.url, json.loads(whole)["id"]) == whole
    got = _get(server.url, streamed_id)
    assert streamed.endswith(f', "response": {got.decode()}}}')
