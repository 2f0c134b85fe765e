"""A pre-warm through chat completions: `max_completion_tokens: 0` (or `max_tokens: 0`) computes the
prompt and keeps it, answering an empty assistant message with finish_reason `length`; the same
conversation afterwards reads all of the prompt but its last token, whole or streamed."""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import openai
import pytest
from fastapi import FastAPI

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from tests.server.live import Server, assert_no_leak

NAME = "m"
SYSTEM = "You are a careful assistant for a shipping company; answer in one short sentence. " * 4


@pytest.fixture(scope="module")
def server(
    make_engine: Callable[..., Engine], serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[Server]:
    async_engine = AsyncEngine(make_engine(max_model_len=1024))
    with serve_app(create_app(async_engine, ServerOptions(served_model_name=NAME))) as url:
        yield Server(url, async_engine)


def _chat(server: Server, system: str, stream: bool, **limit: Any) -> tuple[list[Any], Any]:
    """The choices (or the streamed chunks' choices) and the usage."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    args: Any = {
        "model": NAME,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Where is my parcel?"},
        ],
        "temperature": 0,
        **limit,
    }
    if not stream:
        reply = client.chat.completions.create(**args)
        return list(reply.choices), reply.usage
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    return [c for chunk in chunks for c in chunk.choices], chunks[-1].usage


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("field", ["max_completion_tokens", "max_tokens", "prompt_cache_options"])
def test_a_prewarm_computes_the_prompt_and_the_same_prompt_reads_it(
    server: Server, field: str, stream: bool
) -> None:
    # A prompt of its own, that no other test has cached.
    system = f"({field}, {stream}) {SYSTEM}"
    # OpenAI's own spelling asks for a pre-warm whatever max_tokens says.
    warm = (
        {"max_tokens": 8, "extra_body": {"prompt_cache_options": {"prewarm": True}}}
        if field == "prompt_cache_options"
        else {field: 0}
    )
    choices, usage = _chat(server, system, stream, **warm)
    if stream:
        assert all(not c.delta.content for c in choices)
    else:
        (choice,) = choices
        assert choice.message.content == "" and not choice.message.tool_calls
    assert choices[-1].finish_reason == "length"
    # Nothing but the template's first tokens, which every conversation shares, was cached before.
    assert usage.completion_tokens == 0 and usage.prompt_tokens_details.cached_tokens < 16
    assert usage.total_tokens == usage.prompt_tokens > 64
    assert_no_leak(server.wait_idle())

    _, again = _chat(server, system, stream, max_tokens=2)
    assert again.prompt_tokens == usage.prompt_tokens
    assert again.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    assert_no_leak(server.wait_idle())
