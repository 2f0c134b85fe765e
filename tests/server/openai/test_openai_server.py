"""The OpenAI-compatible server, end to end: a real uvicorn server around a real engine and the default
model, driven by the official openai client and by raw HTTP."""

import asyncio
import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from kvserve import __version__
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from kvserve.server.core.output import ResponseIds
from kvserve.server.openai import routes as openai_routes
from kvserve.server.openai.formats import CompletionFormat
from tests.server.live import Server, assert_no_leak

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def server(
    make_engine: Callable[..., Engine], serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[Server]:
    async_engine = AsyncEngine(make_engine(kv_cache_memory=256 * 2**20, max_model_len=MAX_MODEL_LEN))
    with serve_app(create_app(async_engine, ServerOptions())) as url:
        yield Server(url, async_engine)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def sse_events(raw: str) -> list[str]:
    """The data of each event; asserts the framing: `data: <one line>` then a blank line, nothing else."""
    assert raw.endswith("\n\n")
    events = raw.split("\n\n")[:-1]
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, event
    return [event.removeprefix("data: ") for event in events]


def test_models_health_version(server: Server, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}


def test_chat_with_openai_client_streamed_and_not(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Name a color."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert whole.object == "chat.completion"
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    usage = whole.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert 1 <= usage.completion_tokens <= 8
    # Cut at max_tokens, or ended by the model's end-of-turn token before it.
    assert choice.finish_reason == ("length" if usage.completion_tokens == 8 else "stop")
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        choice.finish_reason
    ]
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.usage.prompt_tokens_details is not None
    assert last.usage.prompt_tokens == usage.prompt_tokens
    assert last.usage.completion_tokens == usage.completion_tokens
    # The same prompt again: everything but the token that must be recomputed comes from the cache.
    assert (last.usage.prompt_tokens_details.cached_tokens or 0) >= usage.prompt_tokens - 16


def test_completions_with_openai_client_streamed_and_not(server: Server, client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert whole.object == "text_completion"
    text = whole.choices[0].text
    assert whole.usage is not None and whole.usage.completion_tokens <= 6
    assert text and whole.choices[0].finish_reason == (
        "length" if whole.usage.completion_tokens == 6 else "stop"
    )

    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == text

    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_next_chat_turn_finds_the_history_in_the_cache(client: openai.OpenAI) -> None:
    history: Any = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=16, temperature=0)
    assert first.usage is not None
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And of Italy?"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=history, max_tokens=16, temperature=0)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 16


def test_sse_framing_and_usage_fields(server: Server) -> None:
    body = {
        "messages": [{"role": "user", "content": "Hi!"}],
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.read().decode())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and chunks[0]["id"].startswith("chatcmpl-")
    for c in chunks:
        assert c["object"] == "chat.completion.chunk" and c["model"] == MODEL
        assert "usage" not in c  # no stream_options.include_usage
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}

    body = {"prompt": "Hello", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        events = sse_events(r.read().decode())
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks[:-1])
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 3
    assert set(usage) >= {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}

    # Usage is always whole, a zero included.
    whole = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1}, timeout=60
    )
    assert whole.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0}


ANY_PARAM = "(not checked)"
LONG_PROMPT = "hello " * (MAX_MODEL_LEN + 50)
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        (CHAT, b'{"messages": [', 400, None),
        (CHAT, b"[1, 2]", 400, None),
        (CHAT, b"", 400, None),
        (CHAT, {"messages": "hi"}, 400, "messages"),
        (CHAT, {"messages": []}, 400, "messages"),
        (CHAT, {"max_tokens": 4}, 400, "messages"),
        (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "messages[0].content[0]",
        ),
        (CHAT, {"model": "gpt-4o", "messages": HI}, 404, "model"),
        (CHAT, {"messages": HI, "max_tokens": MAX_MODEL_LEN + 1}, 400, "max_tokens"),
        (CHAT, {"messages": HI, "max_completion_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
        (CHAT, {"messages": HI, "max_tokens": -1}, 400, "max_tokens"),
        (CHAT, {"messages": HI, "max_tokens": "many"}, 400, "max_tokens"),
        (CHAT, {"messages": HI, "temperature": -1}, 400, "temperature"),
        (CHAT, {"messages": HI, "temperature": -1, "stream": True}, 400, "temperature"),
        (CHAT, {"messages": HI, "top_p": 0}, 400, "top_p"),
        (CHAT, {"messages": HI, "top_k": -2}, 400, "top_k"),
        (CHAT, {"messages": HI, "min_p": 1.5}, 400, "min_p"),
        (CHAT, {"messages": HI, "seed": -1}, 400, "seed"),
        (CHAT, {"messages": HI, "n": 0}, 400, "n"),
        (CHAT, {"messages": HI, "stop": [""]}, 400, "stop"),
        (CHAT, {"messages": HI, "stream": "sometimes"}, 400, "stream"),
        ("/v1/completions", {"prompt": LONG_PROMPT}, 400, ANY_PARAM),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt"),
        ("/v1/completions", {"prompt": {"text": "hi"}}, 400, "prompt"),
        ("/tokenize", {"model": MODEL}, 400, None),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/v1/nowhere", {}, 404, None),
    ],
)
def test_bad_requests_get_openai_errors(
    server: Server, path: str, body: bytes | dict[str, Any], status: int, param: str | None
) -> None:
    if isinstance(body, bytes):
        r = httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert param == ANY_PARAM or error["param"] == param
    assert len(error["message"]) > 10 and "Traceback" not in r.text


def test_errors_say_what_to_fix(server: Server) -> None:
    def message(path: str, body: Any) -> str:
        return str(httpx.post(f"{server.url}{path}", json=body, timeout=60).json()["error"]["message"])

    malformed = httpx.post(f"{server.url}{CHAT}", content=b"{", headers={"content-type": "application/json"})
    assert "not valid JSON" in malformed.json()["error"]["message"]
    assert "maximum context length" in message("/v1/completions", {"prompt": LONG_PROMPT})
    assert "max_tokens" in message(CHAT, {"messages": HI, "max_tokens": MAX_MODEL_LEN + 1})
    assert MODEL in message(CHAT, {"model": "gpt-4o", "messages": HI})
    assert "role" in message(CHAT, {"messages": [{"role": "robot", "content": "hi"}]})


def test_unknown_fields_are_ignored_and_the_model_may_be_left_out(server: Server) -> None:
    body = {
        "messages": HI,
        "max_tokens": 2,
        "frequency_penalty": 0.5,
        "logit_bias": {"1": 2},
        "whatever": [1],
    }
    r = httpx.post(f"{server.url}{CHAT}", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_a_reply_without_reasoning_names_no_reasoning_field(server: Server) -> None:
    """Regression: every reply carried `reasoning_content` and `reasoning` as nulls, and a client that
    sends the message back through SMG got a 400 there (SMG reads the two names as one field twice)."""
    r = httpx.post(f"{server.url}{CHAT}", json={"messages": HI, "max_tokens": 2}, timeout=60)
    message = r.json()["choices"][0]["message"]
    assert r.status_code == 200 and message["role"] == "assistant"
    assert "reasoning_content" not in message and "reasoning" not in message


def test_unexpected_errors_answer_500_without_details(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any) -> Any:
        raise RuntimeError("internal detail")

    monkeypatch.setattr(openai_routes, "completion_plan", broken)
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, timeout=60)
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert "internal detail" not in r.text and "Traceback" not in r.text
    monkeypatch.undo()
    assert (
        httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
    )


def test_an_error_mid_stream_ends_it_with_an_error_event_and_aborts(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = CompletionFormat.chunk
    calls = 0

    def fails_on_second_chunk(self: CompletionFormat, ids: ResponseIds, *args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("internal detail")
        return original(self, ids, *args)

    monkeypatch.setattr(CompletionFormat, "chunk", fails_on_second_chunk)
    before = server.call(lambda e: e.generation_tokens)
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = sse_events(r.read().decode())
    assert len(events) == 3 and events[-1] == "[DONE]"
    assert json.loads(events[0])["choices"][0]["text"]
    error = json.loads(events[1])["error"]
    assert error["type"] == "server_error" and "internal detail" not in events[1]
    stats = server.wait_idle()
    assert stats.generation_tokens - before < 1500
    assert_no_leak(stats)


TOPICS = [f"the number {i}" for i in range(32)]


def test_concurrent_streams_are_batched_and_match_sequential_runs(server: Server) -> None:
    async def stream_one(client: httpx.AsyncClient, topic: str) -> tuple[str, str, int]:
        body = {
            "messages": [{"role": "user", "content": f"Write one short sentence about {topic}."}],
            "max_tokens": 6,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        text, finish, tokens = "", "", -1
        async with client.stream("POST", CHAT, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                for choice in chunk["choices"]:
                    text += choice["delta"].get("content", "")
                    finish = choice["finish_reason"] or finish
                if chunk["usage"]:
                    tokens = chunk["usage"]["completion_tokens"]
        return text, finish, tokens

    async def largest_batch(done: asyncio.Event) -> int:
        largest = 0
        while not done.is_set():
            largest = max(largest, await server.async_engine.call(lambda e: len(e.scheduler.running)))
            await asyncio.sleep(0.02)
        return largest

    async def run() -> tuple[list[tuple[str, str, int]], list[tuple[str, str, int]], int]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as client:
            done = asyncio.Event()
            watcher = asyncio.create_task(largest_batch(done))
            together = await asyncio.gather(*(stream_one(client, t) for t in TOPICS))
            done.set()
            alone = [await stream_one(client, t) for t in TOPICS]
        return list(together), alone, await watcher

    together, alone, batch = asyncio.run(run())
    assert len(TOPICS) == 32
    assert together == alone
    assert all(text and tokens >= 1 for text, _, tokens in together)
    assert batch > 1
    assert_no_leak(server.wait_idle())


def test_client_leaving_a_stream_aborts_its_request(server: Server) -> None:
    before = server.call(lambda e: e.generation_tokens)
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break
    # Leaving the block closed the connection mid-stream.
    stats = server.wait_idle()
    assert stats.generation_tokens - before < 1500
    assert_no_leak(stats)


def test_client_leaving_a_whole_response_aborts_its_request(server: Server) -> None:
    before = server.call(lambda e: e.generation_tokens)
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    stats = server.wait_idle()
    assert stats.generation_tokens - before < 1500
    assert_no_leak(stats)


def scrape(server: Server) -> tuple[dict[str, float], dict[str, str]]:
    """Sample values by name (labels dropped, one model) and family types by name."""
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values: dict[str, float] = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(r.text):
        types[family.name] = family.type
        for sample in family.samples:
            key = sample.name + (
                "" if "finish_reason" not in sample.labels else f"/{sample.labels['finish_reason']}"
            )
            values[key] = values.get(key, 0.0) + sample.value
    return values, types


def test_metrics_parse_and_follow_the_prefix_cache(server: Server, client: openai.OpenAI) -> None:
    before, types = scrape(server)
    assert types["vllm:prefix_cache_queries"] == "counter" and types["vllm:prefix_cache_hits"] == "counter"
    assert types["vllm:kv_cache_usage_perc"] == "gauge"
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert types[f"kvserve_{name}"] == "histogram"
    for name in ("prefix_cache_queries", "prefix_cache_hits", "kv_cache_evicted_blocks", "preemptions"):
        assert types[f"kvserve_{name}"] == "counter"
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "prefix_cache_hit_rate",
        "kv_cache_cached_blocks",
    ):
        assert types[f"kvserve_{name}"] == "gauge"

    prompt = "Metrics test: " + " ".join(f"item {i}," for i in range(30))

    def complete() -> Any:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0).usage

    first = complete()
    middle, _ = scrape(server)
    second = complete()
    after, _ = scrape(server)
    for usage, start, end in ((first, before, middle), (second, middle, after)):
        assert (
            end["vllm:prefix_cache_queries_total"] - start["vllm:prefix_cache_queries_total"]
            == usage.prompt_tokens
        )
        hits = end["vllm:prefix_cache_hits_total"] - start["vllm:prefix_cache_hits_total"]
        assert hits == usage.prompt_tokens_details.cached_tokens
        assert end["kvserve_prefix_cache_hits_total"] - start["kvserve_prefix_cache_hits_total"] == hits
        assert (
            end["kvserve_time_to_first_token_seconds_count"]
            - start["kvserve_time_to_first_token_seconds_count"]
            == 1
        )
        assert (
            end["kvserve_e2e_request_latency_seconds_count"]
            - start["kvserve_e2e_request_latency_seconds_count"]
            == 1
        )
        assert end["kvserve_generation_tokens_total"] - start["kvserve_generation_tokens_total"] == 3
    assert second.prompt_tokens_details.cached_tokens >= second.prompt_tokens - 16
    assert (
        after["kvserve_requests_finished_total/length"]
        - before.get("kvserve_requests_finished_total/length", 0)
        == 2
    )
    assert 0 <= after["vllm:kv_cache_usage_perc"] <= 1
    assert after["kvserve_kv_cache_blocks"] == server.call(lambda e: e.num_blocks)


def test_tokenize_matches_what_generation_counts(server: Server, client: openai.OpenAI) -> None:
    prompt = "Tokenize me, please."
    tokenized = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) and tokenized["max_model_len"] == MAX_MODEL_LEN
    usage = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage
    assert usage is not None and usage.prompt_tokens == tokenized["count"]
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tokenized["tokens"]}).json() == {
        "prompt": prompt
    }

    messages: Any = [{"role": "user", "content": [{"type": "text", "text": "Count my tokens."}]}]
    chat = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages}).json()
    chat_usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert chat_usage is not None and chat_usage.prompt_tokens == chat["count"]
