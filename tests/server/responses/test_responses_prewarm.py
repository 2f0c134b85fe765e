"""A pre-warm through the Responses API: `max_output_tokens: 0` computes the prompt and keeps it,
answering an `incomplete` response (reason max_output_tokens) with no output items; the same input
afterwards reads all of the prompt but its last token, whole or streamed, and a stored pre-warm is
continued by `previous_response_id` from the cache."""

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
INSTRUCTIONS = "You are a careful assistant for a shipping company; answer in one short sentence. " * 4


@pytest.fixture(scope="module")
def server(
    make_engine: Callable[..., Engine], serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[Server]:
    async_engine = AsyncEngine(make_engine(max_model_len=1024))
    with serve_app(create_app(async_engine, ServerOptions(served_model_name=NAME))) as url:
        yield Server(url, async_engine)


def _respond(server: Server, stream: bool, **args: Any) -> Any:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    args = {"model": NAME, "temperature": 0, **args}
    if not stream:
        return client.responses.create(**args)
    events = list(client.responses.create(stream=True, **args))
    if args["max_output_tokens"] == 0:
        kinds = [e.type for e in events]
        assert kinds == ["response.created", "response.in_progress", "response.incomplete"], kinds
    return events[-1].response


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_prewarm_computes_the_prompt_and_the_same_input_reads_it(server: Server, stream: bool) -> None:
    # A prompt of its own, that no other test has cached.
    ask: Any = {"instructions": f"({stream}) {INSTRUCTIONS}", "input": "Where is my parcel?", "store": False}
    warm = _respond(server, stream, max_output_tokens=0, **ask)
    assert warm.status == "incomplete" and warm.incomplete_details.reason == "max_output_tokens"
    assert warm.output == []
    usage = warm.usage
    # Nothing but the template's first tokens, which every conversation shares, was cached before.
    assert usage.output_tokens == 0 and usage.input_tokens_details.cached_tokens < 16
    assert usage.total_tokens == usage.input_tokens > 64
    assert_no_leak(server.wait_idle())

    again = _respond(server, stream, max_output_tokens=2, **ask).usage
    assert again.input_tokens == usage.input_tokens
    assert again.input_tokens_details.cached_tokens == usage.input_tokens - 1
    assert_no_leak(server.wait_idle())


def test_a_stored_prewarm_is_continued_from_the_cache(server: Server) -> None:
    history = [{"role": "user", "content": "My parcel number is 8812."}]
    warm = _respond(server, False, instructions=INSTRUCTIONS, input=history, max_output_tokens=0, store=True)
    assert warm.output == []
    follow = [{"role": "user", "content": "Where is it?"}]
    after = {"previous_response_id": warm.id, "max_output_tokens": 2}
    turn = _respond(server, False, instructions=INSTRUCTIONS, input=follow, **after)
    # The continuation renders the pre-warmed conversation (with no reply turn: the pre-warm made
    # none), then its own input, and reads the pre-warmed prompt from the cache.
    whole = _respond(server, False, instructions=INSTRUCTIONS, input=history + follow, max_output_tokens=2)
    assert turn.usage.input_tokens == whole.usage.input_tokens
    assert turn.usage.input_tokens_details.cached_tokens >= warm.usage.input_tokens - 16
    assert_no_leak(server.wait_idle())
