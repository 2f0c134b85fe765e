"""OpenAI's prompt-cache fields over HTTP through the official SDK, on chat completions and Responses.

`prompt_cache_retention: 24h` keeps the whole prompt through a flood of other prompts that cycles the
pool, so the same request reads it all from the cache; without it the flood evicts the prompt (which
shows the flood evicts, so the test can fail). A `prompt_cache_breakpoint` on the system part keeps
that prefix only. `cache_write_tokens` counts what was kept (0 without a breakpoint), and a bad value
is a 400 naming its field.
"""

import random
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from tests.server.live import Server

NAME = "m"
# About 700 tokens of float16 KV for the default model: five 400-token prompts cycle it.
POOL_BYTES = 16 * 2**20
FLOOD_PROMPTS = 5
FLOOD_TOKENS = 400
SYSTEM = "You are a careful assistant for a shipping company; answer in one short sentence. " * 5


@pytest.fixture
def server(
    make_engine: Callable[..., Engine], serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[Server]:
    async_engine = AsyncEngine(make_engine(kv_cache_memory=POOL_BYTES, max_model_len=512))
    with serve_app(create_app(async_engine, ServerOptions(served_model_name=NAME))) as url:
        yield Server(url, async_engine)


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _flood(url: str) -> None:
    rng = random.Random(1)
    for _ in range(FLOOD_PROMPTS):
        prompt = rng.choices(range(1000, 40000), k=FLOOD_TOKENS)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=300)
        assert r.status_code == 200, r.text


def _system_part(marked: bool) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "text", "text": SYSTEM}
    if marked:
        part["prompt_cache_breakpoint"] = {"mode": "explicit"}
    return part


def _chat(client: openai.OpenAI, question: str, marked: bool = False, **fields: Any) -> tuple[int, int, int]:
    """(prompt, cached, written) tokens of one chat turn."""
    messages: list[Any] = [
        {"role": "system", "content": [_system_part(marked)]},
        {"role": "user", "content": question},
    ]
    reply = client.chat.completions.create(
        model=NAME,
        max_tokens=2,
        temperature=0,
        messages=messages,
        **fields,
    )
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    details = usage.prompt_tokens_details
    return usage.prompt_tokens, details.cached_tokens or 0, details.cache_write_tokens or 0


def _response(
    client: openai.OpenAI, question: str, marked: bool = False, **fields: Any
) -> tuple[int, int, int]:
    """(prompt, cached, written) tokens of one Responses turn."""
    system: dict[str, Any] = {"type": "input_text", "text": SYSTEM}
    if marked:
        system["prompt_cache_breakpoint"] = {"mode": "explicit"}
    items: list[Any] = [{"role": "developer", "content": [system]}, {"role": "user", "content": question}]
    reply = client.responses.create(
        model=NAME,
        max_output_tokens=2,
        temperature=0,
        store=False,
        input=items,
        **fields,
    )
    usage = reply.usage
    assert usage is not None
    return (
        usage.input_tokens,
        usage.input_tokens_details.cached_tokens,
        usage.input_tokens_details.cache_write_tokens,
    )


TURNS = {"chat": _chat, "responses": _response}


@pytest.mark.parametrize("api", TURNS)
@pytest.mark.parametrize("retention", ["24h", "in_memory"])
def test_24h_retention_keeps_the_whole_prompt_through_a_flood(
    server: Server, api: str, retention: str
) -> None:
    turn = TURNS[api]
    client = _client(server)
    prompt, cached, written = turn(client, "Where is my parcel?", prompt_cache_retention=retention)
    assert cached == 0
    if retention == "24h":
        # Whole blocks of the prompt, nearly all of it.
        assert prompt - 32 < written <= prompt
    else:
        assert written == 0
    _flood(server.url)
    _, cached_again, written_again = turn(client, "Where is my parcel?", prompt_cache_retention=retention)
    if retention == "24h":
        assert cached_again >= written - 16
        # Read, not written again.
        assert written_again == 0
    else:
        assert cached_again == 0


@pytest.mark.parametrize("api", TURNS)
def test_a_breakpoint_keeps_its_prefix_and_only_it(server: Server, api: str) -> None:
    turn = TURNS[api]
    client = _client(server)
    options = {"prompt_cache_options": {"mode": "explicit"}}
    prompt, cached, written = turn(client, "Where is my parcel?", marked=True, extra_body=options)
    assert cached == 0
    # The system part's blocks: most of the prompt, not its question.
    assert 64 < written < prompt - 4
    _flood(server.url)
    _, cached_again, _ = turn(client, "When does it arrive?", marked=True, extra_body=options)
    assert written - 16 <= cached_again <= written + 16


@pytest.mark.parametrize("api", TURNS)
def test_a_plain_request_writes_nothing(server: Server, api: str) -> None:
    _, _, written = TURNS[api](_client(server), "Where is my parcel?")
    assert written == 0


BAD = [
    ({"prompt_cache_retention": "1w"}, "prompt_cache_retention"),
    ({"prompt_cache_key": "k" * 1025}, "prompt_cache_key"),
    ({"prompt_cache_key": 7}, "prompt_cache_key"),
    ({"prompt_cache_options": "on"}, "prompt_cache_options"),
    ({"prompt_cache_options": {"mode": "always"}}, "prompt_cache_options.mode"),
    ({"prompt_cache_options": {"ttl": "5m"}}, "prompt_cache_options.ttl"),
]


@pytest.mark.parametrize("api", TURNS)
@pytest.mark.parametrize(("fields", "param"), BAD, ids=[p for _, p in BAD])
def test_a_bad_cache_field_is_a_400_naming_it(
    server: Server, api: str, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        TURNS[api](_client(server), "Hi", extra_body=fields)
    body = raised.value.body
    assert isinstance(body, dict)
    assert body.get("param", body.get("error", {}).get("param")) == param


def test_a_bad_breakpoint_marker_is_a_400_naming_its_part(server: Server) -> None:
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "model": NAME,
            "max_tokens": 1,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Hi", "prompt_cache_breakpoint": "yes"}],
                }
            ],
        },
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[0].content[0].prompt_cache_breakpoint"


def test_a_stream_reports_the_write_once_the_reply_is_out(server: Server) -> None:
    client = _client(server)
    messages: list[Any] = [
        {"role": "system", "content": [_system_part(True)]},
        {"role": "user", "content": "Hi"},
    ]
    chunks = client.chat.completions.create(
        model=NAME, max_tokens=2, messages=messages, stream=True, stream_options={"include_usage": True}
    )
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details is not None
    assert 64 < (usage[0].prompt_tokens_details.cache_write_tokens or 0) < usage[0].prompt_tokens
    items: list[Any] = [{"role": "user", "content": "Where is my parcel? " * 20}]
    events = client.responses.create(
        model=NAME,
        max_output_tokens=2,
        input=items,
        store=False,
        stream=True,
        extra_body={"prompt_cache_retention": "24h"},
    )
    # Two tokens end the reply early: its last event is response.incomplete.
    (final,) = [e.response for e in events if e.type in ("response.completed", "response.incomplete")]
    assert final.usage is not None
    assert final.usage.input_tokens - 32 < final.usage.input_tokens_details.cache_write_tokens
