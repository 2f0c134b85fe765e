"""Fuzzing: schemathesis against the server's own OpenAPI schema, and a hand corpus of hostile input
(every finding of the hardening reviews included). Each fuzzed request is sent beside ordinary
requests, all in flight at once: never a 5xx, never a stack trace, every refusal OpenAI-shaped, the
ordinary requests' greedy outputs what they are alone, and the server healthy afterwards."""

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.options import ServerOptions
from kvserve.server.anthropic.errors import is_anthropic_path
from kvserve.server.app import create_app
from kvserve.server.http.tenants import Tenants, load_or_create_secret
from tests.hostile_grammars import deep_nesting, huge_alternation, overlapping_terminals

# Generation is bounded so that a fuzzed request costs milliseconds: a short context and few tokens.
MAX_MODEL_LEN = 256
MAX_TOKENS = 4
EXAMPLES_PER_ROUTE = 30
PINNED_TOKENS = 64
VOCAB = 49_152
TENANT_KEY = "key-tenant-aaaa"
ADMIN_KEY = "key-admin-bbbbb"

# Sent beside every fuzzed request: a greedy one, whose text must not change, and a sampled one with
# top_k 40 (a batch mixing top_k values is what finding 1 of the review overflowed), which must succeed.
GREEDY = {
    "prompt": "The capital of France is",
    "max_tokens": MAX_TOKENS,
    "temperature": 0,
    "ignore_eos": True,
}
SAMPLED = {
    "prompt": "Once upon a time",
    "max_tokens": MAX_TOKENS,
    "temperature": 1,
    "top_k": 40,
    "seed": 7,
    "ignore_eos": True,
}


@dataclass
class Target:
    """A server under fuzzing, with the greedy text its ordinary request gets alone."""

    url: str
    headers: dict[str, str] = field(default_factory=dict)
    greedy_text: str = ""

    async def ordinary(self, client: httpx.AsyncClient, body: dict[str, Any]) -> str:
        r = await client.post(f"{self.url}/v1/completions", json=body, headers=self.headers)
        assert r.status_code == 200, ("an ordinary request beside the fuzzing failed", r.text)
        text: str = r.json()["choices"][0]["text"]
        return text

    async def beside_ordinary(
        self, fuzzed: Callable[[httpx.AsyncClient], Awaitable[tuple[int, str]]]
    ) -> tuple[int, str]:
        """Send the fuzzed request and the ordinary ones together; check the ordinary ones and that the
        server is healthy after; return the fuzzed request's status and body."""
        async with httpx.AsyncClient(timeout=120) as client:
            result, greedy, _ = await asyncio.gather(
                fuzzed(client), self.ordinary(client, GREEDY), self.ordinary(client, SAMPLED)
            )
            assert greedy == self.greedy_text, (greedy, self.greedy_text)
            assert (await client.get(f"{self.url}/health")).status_code == 200
        return result


@contextmanager
def ordinary_traffic(target: Target, streams: int = 2) -> Iterator[list[str]]:
    """Keeps `streams` ordinary greedy requests in flight, one after another, until the block ends;
    yields the texts they got (checked by the caller, once the block is done)."""
    stop = threading.Event()
    texts: list[str] = []
    errors: list[BaseException] = []

    async def stream(client: httpx.AsyncClient) -> None:
        while not stop.is_set():
            texts.append(await target.ordinary(client, GREEDY))

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.gather(*(stream(client) for _ in range(streams)))

    def main() -> None:
        try:
            asyncio.run(run())
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    try:
        yield texts
    finally:
        stop.set()
        thread.join(120)
    assert not errors, errors


def _start(target: Target) -> Target:
    async def alone() -> str:
        async with httpx.AsyncClient(timeout=120) as client:
            return await target.ordinary(client, GREEDY)

    target.greedy_text = asyncio.run(alone())
    return target


@contextmanager
def open_server(
    make_engine: Callable[..., Engine], serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[Target]:
    """No keys, pinning on."""
    engine = make_engine(
        kv_cache_memory=32 * 2**20, max_model_len=MAX_MODEL_LEN, max_pinned_tokens=PINNED_TOKENS
    )
    with serve_app(create_app(AsyncEngine(engine), ServerOptions())) as url:
        yield _start(Target(url))


@contextmanager
def keyed_server(
    folder: Path,
    make_engine: Callable[..., Engine],
    serve_app: Callable[[FastAPI], AbstractContextManager[str]],
) -> Iterator[Target]:
    """A tenant key and an admin key, pinning off."""
    (folder / "keys").write_text(f"tenant:{TENANT_KEY}\n")
    tenants = Tenants(load_or_create_secret(str(folder)), key_file=str(folder / "keys"))
    engine = make_engine(kv_cache_memory=32 * 2**20, max_model_len=MAX_MODEL_LEN)
    with serve_app(create_app(AsyncEngine(engine), ServerOptions(admin_key=ADMIN_KEY), tenants)) as url:
        yield _start(Target(url, {"Authorization": f"Bearer {TENANT_KEY}"}))


@pytest.fixture(scope="module")
def fuzz_target(
    make_engine: Callable[..., Engine], serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[Target]:
    with open_server(make_engine, serve_app) as target:
        yield target


@pytest.fixture(scope="module")
def keyed_target(
    tmp_path_factory: pytest.TempPathFactory,
    make_engine: Callable[..., Engine],
    serve_app: Callable[[FastAPI], AbstractContextManager[str]],
) -> Iterator[Target]:
    with keyed_server(tmp_path_factory.mktemp("fuzz-keys"), make_engine, serve_app) as target:
        yield target


def _bound_generation(body: Any, path: str) -> None:
    if not isinstance(body, dict):
        return
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
            body[name] = MAX_TOKENS
    # Left out or null, a reply may run to the end of the context: bounded too, by the route's own field.
    limit = "max_output_tokens" if path.startswith("/v1/responses") else "max_tokens"
    if body.get(limit) is None:
        body[limit] = MAX_TOKENS


def assert_answered_cleanly(status: int, text: str, path: str = "") -> None:
    """Never a 5xx or a trace; a refusal in the route's API's shape (Anthropic's on /v1/messages)."""
    assert status < 500, text
    assert "Traceback" not in text
    if status >= 400:
        body = json.loads(text)
        error = body["error"]
        if is_anthropic_path(path):
            assert body["type"] == "error" and set(error) == {"type", "message"} and error["message"], text
        else:
            assert set(error) == {"message", "type", "param", "code"} and error["message"], text


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_schemathesis_finds_no_server_error(fuzz_target: Target, mode: GenerationMode) -> None:
    """Every operation of /openapi.json, with valid bodies (positive) and bodies that break the schema
    (negative), all beside a steady stream of ordinary greedy requests; derandomized so that a run is
    repeatable."""
    api = schemathesis.openapi.from_url(f"{fuzz_target.url}/openapi.json")
    with ordinary_traffic(fuzz_target) as texts:
        fuzz_every_operation(api, fuzz_target, mode)
    # Each case ran while ordinary requests were in flight; each of them got its greedy text.
    assert texts and set(texts) == {fuzz_target.greedy_text}
    # Fuzzed pins may hold the pin cap for days: released, so that the corpora's own pins find the cap
    # as configured whatever the fuzzer happened to draw.
    for pin in httpx.get(f"{fuzz_target.url}/v1/cache", timeout=30).json()["pins"]:
        assert httpx.delete(f"{fuzz_target.url}/v1/cache/pin/{pin['id']}", timeout=30).status_code == 200


def fuzz_every_operation(api: Any, fuzz_target: Target, mode: GenerationMode) -> None:
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
            _bound_generation(case.body, case.operation.path)
            response = case.call(base_url=fuzz_target.url, timeout=120)
            assert_answered_cleanly(response.status_code, response.text, case.operation.path)

        run()


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


MB = "x" * 2**20
# (what, path, JSON body or raw bytes, whether it must be refused with a 4xx; None: a 4xx or a 200,
# whichever the validation's policy is, as long as nothing breaks)
CORPUS: list[tuple[str, str, Any, bool | None]] = [
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
    ("min_p 2", "/v1/completions", {"prompt": "Hi", "min_p": 2, "max_tokens": 1}, True),
    ("seed -1", "/v1/completions", {"prompt": "Hi", "seed": -1, "max_tokens": 1}, True),
    ("seed 2^64", "/v1/completions", {"prompt": "Hi", "seed": 2**64, "max_tokens": 1}, True),
    ("n 10^9", "/v1/completions", {"prompt": "Hi", "n": 10**9, "max_tokens": 1}, True),
    ("token id -1", "/v1/completions", {"prompt": [-1], "max_tokens": 1}, True),
    ("token id 10^20", "/v1/completions", {"prompt": [10**20], "max_tokens": 1}, True),
    ("empty token ids", "/v1/completions", {"prompt": [], "max_tokens": 1}, True),
    ("stop id huge", "/v1/completions", {"prompt": "Hi", "stop_token_ids": [2**70], "max_tokens": 1}, True),
    ("detokenize huge", "/detokenize", {"tokens": [10**30]}, True),
    ("detokenize negative", "/detokenize", {"tokens": [-1]}, True),
    ("tokenize both", "/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, True),
    ("tokenize neither", "/tokenize", {}, True),
    ("messages deep JSON", "/v1/messages", _deep(100_000).encode(), True),
    (
        "messages deep content",
        "/v1/messages",
        f'{{"max_tokens": 1, "messages": {_deep(20_000)}}}'.encode(),
        True,
    ),
    (
        "messages image block",
        "/v1/messages",
        {"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        True,
    ),
    (
        "messages unknown tool_use_id",
        "/v1/messages",
        {
            "max_tokens": 1,
            "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}],
        },
        True,
    ),
    (
        "messages max_tokens -1",
        "/v1/messages",
        {"max_tokens": -1, "messages": [{"role": "user", "content": "Hi"}]},
        True,
    ),
    (
        "messages max_tokens 2^70",
        "/v1/messages",
        {"max_tokens": 2**70, "messages": [{"role": "user", "content": "Hi"}]},
        True,
    ),
    (
        "messages bad ttl",
        "/v1/messages",
        {
            "max_tokens": 1,
            "messages": [{"role": "user", "content": "Hi"}],
            "cache_control": {"type": "ephemeral", "ttl": "9h"},
        },
        True,
    ),
    (
        "messages wrong role",
        "/v1/messages",
        {"max_tokens": 1, "messages": [{"role": "tool", "content": "Hi"}]},
        True,
    ),
    (
        "messages NUL",
        "/v1/messages",
        {"max_tokens": 1, "messages": [{"role": "user", "content": "a\x00b"}], "stream": True},
        False,
    ),
    ("count_tokens no messages", "/v1/messages/count_tokens", {"messages": []}, True),
]


def _bias(entries: int, value: float = 1.0, first: int = 0) -> dict[str, float]:
    return {str(first + t): value for t in range(entries)}


@dataclass(frozen=True)
class Case:
    """One hostile request: `expect` True for a 4xx, False for a 200, None for either. `keyed` sends it
    to the server with keys and pinning off, with `headers`."""

    what: str
    path: str
    body: Any
    expect: bool | None
    keyed: bool = False
    headers: dict[str, str] = field(default_factory=dict)


TENANT = {"Authorization": f"Bearer {TENANT_KEY}"}
# Overlapping alternatives in a tool's JSON schema: the lexer of the tools' grammar multiplies its states.
OVERLAPPING_PATTERN = "^([a-z]*a[a-z]{6}|[a-z]*b[a-z]{7}|[a-z]*c[a-z]{8})+$"
HI = {"prompt": "Hi", "max_tokens": 1}
# Decodes as long as the ordinary requests, so that their steps are sampled in one batch.
LONG = {"prompt": "Hi", "max_tokens": MAX_TOKENS, "ignore_eos": True}
# The findings of the second hardening review, each as the request that showed it.
HARDENING_FINDINGS = [
    Case("top_k 2^63 beside top_k 40", "/v1/completions", {**LONG, "temperature": 1, "top_k": 2**63}, True),
    Case("top_k 10^30 sampled", "/v1/completions", {**LONG, "temperature": 1, "top_k": 10**30}, True),
    Case("top_k vocab", "/v1/completions", {**HI, "temperature": 1, "top_k": VOCAB, "seed": 3}, False),
    # An HTTP client cannot send a header value ending in a space: "Bearer" is the empty key.
    Case("empty bearer on admin", "/reset_prefix_cache", {}, True, True, {"Authorization": "Bearer"}),
    Case("empty bearer", "/v1/completions", HI, True, True, {"Authorization": "Bearer"}),
    Case("empty key", "/v1/completions", HI, True, True, {"Authorization": ""}),
    Case("bearer of spaces", "/v1/completions", HI, True, True, {"Authorization": "Bearer \t x"}),
    Case("tenant key on admin", "/reset_prefix_cache", {}, True, True, TENANT),
    Case("pin ids 2^64", "/v1/cache/pin", {"prompt": [2**64] * 32, "ttl_s": 60}, True),
    Case("pin ids -1", "/v1/cache/pin", {"prompt": [-1] * 32, "ttl_s": 60}, True),
    Case("pin ids vocab", "/v1/cache/pin", {"prompt": [VOCAB] * 32, "ttl_s": 60}, True),
    Case("pin ids ok", "/v1/cache/pin", {"prompt": list(range(100, 132)), "ttl_s": 1}, False),
    Case("pin over the context", "/v1/cache/pin", {"prompt": "word " * 200_000, "ttl_s": 60}, True),
    Case("pin pinning off", "/v1/cache/pin", {"prompt": "word " * 200_000, "ttl_s": 60}, True, True, TENANT),
    Case("pin ids pinning off", "/v1/cache/pin", {"prompt": [2**64] * 32, "ttl_s": 60}, True, True, TENANT),
    Case("100,000 prompts", "/v1/completions", {"prompt": [[1, 2]] * 100_000, "max_tokens": 1}, True),
    Case("100,000 text prompts", "/v1/completions", {"prompt": ["Hi"] * 100_000, "max_tokens": 1}, True),
    Case(
        "10 prompts x n=128, vocabulary-wide logit_bias",
        "/v1/completions",
        {"prompt": ["Hi"] * 10, "n": 128, "max_tokens": 1, "logit_bias": _bias(VOCAB)},
        True,
    ),
    Case(
        "chat n=257",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "n": 257},
        True,
    ),
    Case("n x prompts 257", "/v1/completions", {"prompt": [[1]] * 257, "max_tokens": 1}, True),
    Case("logit_bias vocabulary-wide", "/v1/completions", {**HI, "n": 2, "logit_bias": _bias(VOCAB)}, False),
    Case("logit_bias 1e308", "/v1/completions", {**HI, "logit_bias": {"5": 1e308}}, True),
    Case("logit_bias -1e308", "/v1/completions", {**HI, "logit_bias": {"5": -1e308}}, True),
    Case("logit_bias 101", "/v1/completions", {**HI, "logit_bias": {"5": 101}}, True),
    Case("logit_bias NaN", "/v1/completions", b'{"prompt": "Hi", "logit_bias": {"5": NaN}}', True),
    Case("logit_bias Infinity", "/v1/completions", b'{"prompt": "Hi", "logit_bias": {"5": -Infinity}}', True),
    Case("logit_bias 1e400", "/v1/completions", b'{"prompt": "Hi", "logit_bias": {"5": 1e400}}', True),
    Case("logit_bias key not an id", "/v1/completions", {**HI, "logit_bias": {"five": 1}}, True),
    Case("logit_bias key -1", "/v1/completions", {**HI, "logit_bias": {"-1": 1}}, True),
    Case(
        "logit_bias key vocab",
        "/v1/completions",
        {**HI, "temperature": 1, "logit_bias": {str(VOCAB): 5}},
        True,
    ),
    Case("logit_bias key 2^64", "/v1/completions", {**HI, "logit_bias": {str(2**64): 5}}, True),
    Case(
        "logit_bias over the vocabulary",
        "/v1/completions",
        {**HI, "logit_bias": _bias(VOCAB + 1)},
        True,
    ),
    Case("presence_penalty 1e308", "/v1/completions", {**HI, "presence_penalty": 1e308}, True),
    Case("frequency_penalty -1e308", "/v1/completions", {**HI, "frequency_penalty": -1e308}, True),
    Case("repetition_penalty 0", "/v1/completions", {**HI, "repetition_penalty": 0}, True),
    Case("repetition_penalty 1e308", "/v1/completions", {**HI, "repetition_penalty": 1e308}, True),
    Case(
        "penalties at their bounds",
        "/v1/completions",
        {**HI, "presence_penalty": 2, "frequency_penalty": -2, "repetition_penalty": 100},
        False,
    ),
    Case("min_tokens over max_tokens", "/v1/completions", {**HI, "min_tokens": 2}, True),
    Case(
        "min_tokens 2^63",
        "/v1/completions",
        # Close to the end of the context, so that the completion stops soon where it is accepted.
        {"prompt": list(range(100, 100 + MAX_MODEL_LEN - 8)), "min_tokens": 2**63, "max_tokens": None},
        True,
    ),
    Case("seed 2^64-1", "/v1/completions", {**HI, "seed": 2**64 - 1}, None),
    Case("seed 0 sampled", "/v1/completions", {**HI, "temperature": 1, "seed": 0}, False),
    Case("stop id vocab", "/v1/completions", {**HI, "stop_token_ids": [VOCAB]}, None),
    Case(
        "logprobs 20 chat",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "logprobs": True,
            "top_logprobs": 20,
            "max_tokens": 1,
        },
        False,
    ),
    Case("echo logprobs", "/v1/completions", {**HI, "echo": True, "logprobs": 5}, False),
    Case("temperature 100 top_p tiny", "/v1/completions", {**HI, "temperature": 100, "top_p": 1e-300}, False),
    Case("min_p 1", "/v1/completions", {**HI, "temperature": 1, "min_p": 1}, False),
    Case("top_k -1", "/v1/completions", {**HI, "temperature": 1, "top_k": -1}, False),
    # Hostile grammars: refused at compile time or ended alone ("grammar_limit"), never a stall.
    Case(
        "60 overlapping regex terminals, n=4",
        "/v1/completions",
        {"prompt": "Hi", "n": 4, "max_tokens": 24, "guided_grammar": overlapping_terminals()},
        None,
    ),
    Case(
        "the same overlapping terminals again",
        "/v1/completions",
        {"prompt": "Hi", "n": 4, "max_tokens": 24, "guided_grammar": overlapping_terminals()},
        None,
    ),
    Case(
        "5,000 alternatives",
        "/v1/completions",
        {"prompt": "Hi", "max_tokens": MAX_TOKENS, "guided_grammar": huge_alternation(5000)},
        None,
    ),
    Case(
        "rules nested 300 deep",
        "/v1/completions",
        {"prompt": "Hi", "max_tokens": MAX_TOKENS, "guided_grammar": deep_nesting(300)},
        None,
    ),
    Case(
        "overlapping terminals as a tool's pattern",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": MAX_TOKENS,
            "tool_choice": "required",
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {
                                "a": {"type": "string", "pattern": "^([a-z]*a[a-z]{6}|[a-z]*b[a-z]{7})+$"}
                            },
                            "required": ["a"],
                        },
                    },
                }
            ],
        },
        None,
    ),
]


def _check(target: Target, case: Case) -> None:
    async def fuzzed(client: httpx.AsyncClient) -> tuple[int, str]:
        # Encoded here, ASCII-escaped, so that lone surrogates travel as JSON escapes.
        content = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
        headers = {"Content-Type": "application/json", **case.headers}
        r = await client.post(f"{target.url}{case.path}", content=content, headers=headers)
        return r.status_code, r.text

    status, text = asyncio.run(target.beside_ordinary(fuzzed))
    assert_answered_cleanly(status, text, case.path)
    if case.expect is True:
        assert 400 <= status < 500, (case.what, text[:500])
    elif case.expect is False:
        assert status == 200, (case.what, text[:500])


@pytest.mark.parametrize(
    "case", [Case(what, path, body, refused) for what, path, body, refused in CORPUS], ids=lambda c: c.what
)
def test_hand_corpus(fuzz_target: Target, case: Case) -> None:
    _check(fuzz_target, case)


@pytest.mark.parametrize("case", HARDENING_FINDINGS, ids=lambda c: c.what)
def test_every_hardening_finding_is_refused_or_served_safely(
    case: Case, request: pytest.FixtureRequest
) -> None:
    """Each finding of the review beside ordinary requests, on the shared servers: none may stop them."""
    _check(request.getfixturevalue("keyed_target" if case.keyed else "fuzz_target"), case)


def test_the_server_is_healthy_after_the_fuzzing(fuzz_target: Target, keyed_target: Target) -> None:
    for target in (fuzz_target, keyed_target):
        assert httpx.get(f"{target.url}/health", timeout=30).status_code == 200
        r = httpx.post(f"{target.url}/v1/completions", json=GREEDY, headers=target.headers, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == target.greedy_text
