"""Fuzzing: schemathesis against the server's own OpenAPI schema, and a hand corpus of hostile input.
Never a 5xx, never a stack trace, every refusal OpenAI-shaped, and the server healthy afterwards."""

import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx
import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.server.app import create_app

# Generation is bounded so that a fuzzed request costs milliseconds: a short context and few tokens.
MAX_MODEL_LEN = 256
MAX_TOKENS = 4
EXAMPLES_PER_ROUTE = 30


@pytest.fixture(scope="module")
def fuzz_url(
    make_engine: Callable[..., Engine], serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[str]:
    async_engine = AsyncEngine(make_engine(kv_cache_memory=32 * 2**20, max_model_len=MAX_MODEL_LEN))
    with serve_app(create_app(async_engine)) as url:
        yield url


def _bound_generation(body: Any) -> None:
    if not isinstance(body, dict):
        return
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
            body[field] = MAX_TOKENS
    # Left out or null, a completion may run to the end of the context: bounded too.
    if body.get("max_tokens") is None:
        body["max_tokens"] = MAX_TOKENS


def assert_answered_cleanly(status: int, text: str) -> None:
    assert status < 500, text
    assert "Traceback" not in text
    if status >= 400:
        error = json.loads(text)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], text


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_schemathesis_finds_no_server_error(fuzz_url: str, mode: GenerationMode) -> None:
    """Every operation of /openapi.json, with valid bodies (positive) and bodies that break the schema
    (negative); derandomized so that a run is repeatable."""
    api = schemathesis.openapi.from_url(f"{fuzz_url}/openapi.json")
    for result in api.get_all_operations():
        operation = result.ok()
        if mode == GenerationMode.NEGATIVE and (
            operation.method.upper() != "POST" or not len(operation.body)
        ):
            # Only a body can break the schema: a path parameter is any string, and some routes take nothing.
            continue

        @given(case=operation.as_strategy(mode))
        @settings(
            max_examples=EXAMPLES_PER_ROUTE,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
            derandomize=True,
        )
        def run(case: Any) -> None:
            _bound_generation(case.body)
            response = case.call(base_url=fuzz_url, timeout=120)
            assert_answered_cleanly(response.status_code, response.text)

        run()


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


MB = "x" * 2**20
# (what, path, JSON body or raw bytes, whether it must be refused with a 4xx)
CORPUS: list[tuple[str, str, Any, bool]] = [
    ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe\xfd", "max_tokens": 1}', True),
    ("not JSON", "/v1/completions", b"{prompt: hi", True),
    ("empty body", "/v1/chat/completions", b"", True),
    ("NaN", "/v1/completions", b'{"prompt": "Hi", "temperature": NaN, "max_tokens": 1}', True),
    ("Infinity", "/v1/completions", b'{"prompt": "Hi", "top_p": Infinity, "max_tokens": 1}', True),
    ("deep JSON", "/v1/completions", _deep(100_000).encode(), True),
    ("deep field", "/v1/completions", f'{{"prompt": {_deep(50_000)}}}'.encode(), True),
    ("deep content", "/v1/chat/completions", f'{{"messages": {_deep(20_000)}}}'.encode(), True),
    ("NUL bytes", "/v1/completions", {"prompt": "a\x00b\x00", "max_tokens": 1}, False),
    (
        "NUL in chat",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "\x00"}], "max_tokens": 1},
        False,
    ),
    ("1 MB prompt", "/v1/completions", {"prompt": MB, "max_tokens": 1}, True),
    ("1 MB message", "/v1/chat/completions", {"messages": [{"role": "user", "content": MB}]}, True),
    ("1 MB stop", "/v1/completions", {"prompt": "Hi", "stop": MB, "max_tokens": 1}, True),
    ("1 MB model", "/v1/completions", {"prompt": "Hi", "model": MB, "max_tokens": 1}, True),
    ("1 MB tokenize", "/tokenize", {"prompt": MB}, True),
    ("lone surrogate prompt", "/v1/completions", {"prompt": "\ud800", "max_tokens": 1}, True),
    (
        "lone surrogate chat",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a\udfff"}]},
        True,
    ),
    ("lone surrogate model", "/v1/completions", {"prompt": "Hi", "model": "\ud800"}, True),
    (
        "unicode stops",
        "/v1/completions",
        {"prompt": "Hi", "stop": ["é", "🙂", "\u200b", "\n\n"], "max_tokens": 2},
        False,
    ),
    ("lone surrogate stop", "/v1/completions", {"prompt": "Hi", "stop": ["\ud800"]}, True),
    ("wrong type prompt", "/v1/completions", {"prompt": 5}, True),
    ("null prompt", "/v1/completions", {"prompt": None}, True),
    ("body is a list", "/v1/completions", [], True),
    ("body is a string", "/v1/chat/completions", "hello", True),
    ("body is null", "/v1/chat/completions", None, True),
    ("messages a string", "/v1/chat/completions", {"messages": "hi"}, True),
    ("messages of ints", "/v1/chat/completions", {"messages": [1, 2]}, True),
    ("empty messages", "/v1/chat/completions", {"messages": []}, True),
    (
        "empty content",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": ""}], "max_tokens": 1},
        False,
    ),
    (
        "role tool",
        "/v1/chat/completions",
        {"messages": [{"role": "tool", "content": "x"}], "max_tokens": 1},
        False,
    ),
    ("role function", "/v1/chat/completions", {"messages": [{"role": "function", "content": "x"}]}, True),
    ("no content", "/v1/chat/completions", {"messages": [{"role": "user"}]}, True),
    ("regex unbalanced", "/v1/completions", {"prompt": "Hi", "guided_regex": "(", "max_tokens": 1}, True),
    ("schema not an object", "/v1/completions", {"prompt": "Hi", "structured_outputs": {"json": 5}}, True),
    ("choice empty", "/v1/completions", {"prompt": "Hi", "guided_choice": []}, True),
    (
        "grammar junk",
        "/v1/completions",
        {"prompt": "Hi", "guided_grammar": "start: (", "max_tokens": 1},
        True,
    ),
    (
        "tool name with a space",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "a b"}}],
        },
        True,
    ),
    ("role case", "/v1/chat/completions", {"messages": [{"role": "User", "content": "x"}]}, True),
    ("no role", "/v1/chat/completions", {"messages": [{"content": "x"}]}, True),
    ("stream not bool", "/v1/completions", {"prompt": "Hi", "stream": "yes please"}, True),
    ("max_tokens -1", "/v1/completions", {"prompt": "Hi", "max_tokens": -1}, True),
    ("max_tokens 2^64", "/v1/completions", {"prompt": "Hi", "max_tokens": 2**64}, True),
    ("max_tokens float", "/v1/completions", {"prompt": "Hi", "max_tokens": 1e308}, True),
    ("temperature -1", "/v1/completions", {"prompt": "Hi", "temperature": -1, "max_tokens": 1}, True),
    ("temperature 1e308", "/v1/completions", {"prompt": "Hi", "temperature": 1e308, "max_tokens": 1}, True),
    ("top_p 0", "/v1/completions", {"prompt": "Hi", "top_p": 0, "max_tokens": 1}, True),
    ("top_k -2", "/v1/completions", {"prompt": "Hi", "top_k": -2, "max_tokens": 1}, True),
    ("top_k 10^30", "/v1/completions", {"prompt": "Hi", "top_k": 10**30, "max_tokens": 1}, False),
    ("min_p 2", "/v1/completions", {"prompt": "Hi", "min_p": 2, "max_tokens": 1}, True),
    ("seed -1", "/v1/completions", {"prompt": "Hi", "seed": -1, "max_tokens": 1}, True),
    ("seed 2^64", "/v1/completions", {"prompt": "Hi", "seed": 2**64, "max_tokens": 1}, True),
    ("n 10^9", "/v1/completions", {"prompt": "Hi", "n": 10**9, "max_tokens": 1}, True),
    ("token id -1", "/v1/completions", {"prompt": [-1], "max_tokens": 1}, True),
    ("token id 10^20", "/v1/completions", {"prompt": [10**20], "max_tokens": 1}, True),
    ("empty token ids", "/v1/completions", {"prompt": [], "max_tokens": 1}, True),
    ("stop id huge", "/v1/completions", {"prompt": "Hi", "stop_token_ids": [2**70], "max_tokens": 1}, False),
    ("detokenize huge", "/detokenize", {"tokens": [10**30]}, True),
    ("detokenize negative", "/detokenize", {"tokens": [-1]}, True),
    ("tokenize both", "/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, True),
    ("tokenize neither", "/tokenize", {}, True),
]


@pytest.mark.parametrize(("what", "path", "body", "refused"), CORPUS, ids=[c[0] for c in CORPUS])
def test_hand_corpus(fuzz_url: str, what: str, path: str, body: Any, refused: bool) -> None:
    # Encoded here, ASCII-escaped, so that lone surrogates travel as JSON escapes.
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    r = httpx.post(f"{fuzz_url}{path}", content=content, headers=headers, timeout=120)
    assert_answered_cleanly(r.status_code, r.text)
    assert (400 <= r.status_code < 500) if refused else r.status_code == 200, (what, r.text[:500])


def test_the_server_is_healthy_after_the_fuzzing(fuzz_url: str) -> None:
    assert httpx.get(f"{fuzz_url}/health", timeout=30).status_code == 200
    r = httpx.post(f"{fuzz_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
