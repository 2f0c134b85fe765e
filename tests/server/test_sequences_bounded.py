"""One request cannot freeze the event loop nor flood the log: its sequences (prompts x n) are bounded
before any is built (--max-sequences-per-request), the engine's queue must have room for all of them up
front, what grows with the request runs off the event loop, and the params of its samples are built
once per request."""

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.loader import LoadedModel
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from tests.harness import engine_with_blocks

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_SEQUENCES = 16
# The engine holds 2 + 6 = 8 sequences in flight, fewer than one request may ask for.
MAX_NUM_SEQS = 2
MAX_WAITING = 6
CAPACITY = MAX_NUM_SEQS + MAX_WAITING


@dataclass
class BoundsServer:
    url: str
    async_engine: AsyncEngine

    def post(self, path: str, body: Any, timeout: float = 120) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=timeout)

    def health(self, timeout: float = 30) -> int:
        return httpx.get(f"{self.url}/health", timeout=timeout).status_code


@pytest.fixture(scope="module")
def server(
    tiny_model: LoadedModel, serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[BoundsServer]:
    engine = engine_with_blocks(
        tiny_model,
        128,
        4,
        max_num_seqs=MAX_NUM_SEQS,
        max_waiting=MAX_WAITING,
        max_sequences_per_request=MAX_SEQUENCES,
    )
    async_engine = AsyncEngine(engine)
    with serve_app(create_app(async_engine, ServerOptions())) as url:
        yield BoundsServer(url, async_engine)


@dataclass
class Calls:
    """Per-sequence work the server did: prompts validated, echo texts decoded, engine streams made."""

    names: list[str]


@pytest.fixture
def calls(server: BoundsServer, monkeypatch: pytest.MonkeyPatch) -> Calls:
    record = Calls([])
    async_engine = server.async_engine
    engine, tokenizer = async_engine.engine, async_engine.tokenizer
    validate, decode, generate = engine.validate_request, tokenizer.decode, async_engine.generate

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            record.names.append(name)
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(engine, "validate_request", counted("validate", validate))
    monkeypatch.setattr(tokenizer, "decode", counted("decode", decode))
    monkeypatch.setattr(async_engine, "generate", counted("generate", generate))
    return record


def abort_lines(caplog: pytest.LogCaptureFixture) -> int:
    return sum("finish abort" in r.getMessage() for r in caplog.records)


def assert_refused(r: httpx.Response, status: int, code: str, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["message"], error
    if param is not None:
        assert error["param"] == param, error


def test_a_batch_over_the_sequence_cap_is_refused_before_any_per_sequence_work(
    server: BoundsServer, calls: Calls, caplog: pytest.LogCaptureFixture
) -> None:
    """Finding 4 of the hardening review: 100,000 token-id prompts were expanded on the event loop
    (one engine stream, one validation and one 'finish abort' log line each) before the queue refused
    them."""
    caplog.set_level(logging.INFO, logger="kvserve.server")
    huge = server.post("/v1/completions", {"prompt": [[1, 2]] * 100_000, "max_tokens": 1})
    assert_refused(huge, 400, "too_many_sequences", "prompt")
    assert "--max-sequences-per-request" in huge.json()["error"]["message"]
    over = server.post("/v1/completions", {"prompt": [[1, 2]] * 4, "n": 5, "max_tokens": 1})
    assert_refused(over, 400, "too_many_sequences", "prompt")
    over_n = server.post("/v1/completions", {"prompt": [1, 2], "n": MAX_SEQUENCES + 1, "max_tokens": 1})
    assert_refused(over_n, 400, "too_many_sequences", "n")
    chat = {"messages": [{"role": "user", "content": "Hi"}], "n": MAX_SEQUENCES + 1, "max_tokens": 1}
    assert_refused(server.post("/v1/chat/completions", chat), 400, "too_many_sequences", "n")
    assert calls.names == []
    assert abort_lines(caplog) == 0
    assert server.health() == 200


def test_a_request_the_queue_cannot_hold_is_refused_whole_before_any_sequence_is_built(
    server: BoundsServer, calls: Calls, caplog: pytest.LogCaptureFixture
) -> None:
    """Room for every sequence is checked up front: nothing is submitted and then aborted, and a refusal
    is not a log line per sequence."""
    caplog.set_level(logging.INFO, logger="kvserve.server")
    # More than the whole queue (but within the cap): it can never run.
    never = server.post("/v1/completions", {"prompt": [[1, 2], [3, 4]], "n": 5, "max_tokens": 1})
    assert_refused(never, 400, "too_many_sequences")
    assert calls.names == []

    # The engine thread held, three requests wait in the queue; six more sequences do not fit beside them.
    holding, release = threading.Event(), threading.Event()

    def hold(engine: Engine) -> None:
        holding.set()
        release.wait(60)

    async def scenario() -> tuple[httpx.Response, list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            held = asyncio.ensure_future(server.async_engine.call(hold))
            while not holding.is_set():
                await asyncio.sleep(0.01)
            waiting = [
                asyncio.ensure_future(
                    client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
                )
                for _ in range(3)
            ]
            while server.async_engine.num_in_flight < 3:
                await asyncio.sleep(0.01)
            before = len(calls.names)
            refused = await client.post(
                "/v1/completions", json={"prompt": [[1, 2], [3, 4], [5, 6]], "n": 2, "max_tokens": 1}
            )
            built = calls.names[before:]
            release.set()
            await held
            answered = list(await asyncio.gather(*waiting))
            assert built == [], built
            fits = await client.post(
                "/v1/completions", json={"prompt": [[1, 2], [3, 4], [5, 6]], "n": 2, "max_tokens": 1}
            )
            return refused, answered, fits

    try:
        refused, answered, fits = asyncio.run(scenario())
    finally:
        release.set()
    assert_refused(refused, 503, "overloaded")
    assert refused.headers["retry-after"] == "1"
    assert abort_lines(caplog) == 0
    assert all(r.status_code == 200 for r in answered), [r.text for r in answered]
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 6, fits.text
    assert server.health() == 200


def test_per_sequence_work_runs_off_the_event_loop(
    server: BoundsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a request's prompts are validated (held here until /health has answered), the event loop
    serves others: were validation on the loop, /health could not answer and would time out."""
    engine = server.async_engine.engine
    validating, health_answered = threading.Event(), threading.Event()
    validate = engine.validate_request

    def slow_validate(*args: Any, **kwargs: Any) -> Any:
        if not validating.is_set():
            validating.set()
            health_answered.wait(60)
        return validate(*args, **kwargs)

    monkeypatch.setattr(engine, "validate_request", slow_validate)
    result: list[httpx.Response] = []
    body = {"prompt": [[1, 2, 3]] * 4, "n": 2, "max_tokens": 1}
    batch = threading.Thread(target=lambda: result.append(server.post("/v1/completions", body)))
    batch.start()
    try:
        assert validating.wait(60)
        assert server.health(timeout=20) == 200
    finally:
        health_answered.set()
        batch.join(60)
    assert result[0].status_code == 200 and len(result[0].json()["choices"]) == 8, result[0].text


def test_the_params_of_each_sample_are_built_once_per_request(
    server: BoundsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each sample's params (and so the check of its logit_bias) are built once, not once per prompt."""
    samples: list[int] = []
    for_sample = SamplingParams.for_sample

    def counted(self: SamplingParams, index: int) -> SamplingParams:
        samples.append(index)
        return for_sample(self, index)

    monkeypatch.setattr(SamplingParams, "for_sample", counted)
    bias = {str(t): 1.0 for t in range(2000)}
    body = {"prompt": [[1, 2], [3, 4]], "n": 3, "max_tokens": 1, "logit_bias": bias, "seed": 7}
    r = server.post("/v1/completions", body)
    assert r.status_code == 200 and len(r.json()["choices"]) == 6, r.text
    assert sorted(samples) == [0, 1, 2]


def test_the_cap_is_a_positive_setting() -> None:
    from kvserve.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--max-sequences-per-request", "0"])
    assert exit_.value.code == 2


def test_a_health_check_that_times_out_does_not_stop_the_engine(
    server: BoundsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A /health whose engine call timed out used to cancel that call's future; the engine thread then
    failed setting its result (InvalidStateError) and stopped for everyone."""
    import kvserve.server.app

    monkeypatch.setattr(kvserve.server.app, "HEALTH_TIMEOUT_S", 0.05)
    holding, release = threading.Event(), threading.Event()

    def hold(engine: Engine) -> None:
        holding.set()
        release.wait(60)

    async def scenario() -> None:
        held = asyncio.ensure_future(server.async_engine.call(hold))
        while not holding.is_set():
            await asyncio.sleep(0.01)
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            r = await client.get("/health")
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable", r.text
        release.set()
        await held
        # The engine thread has run the timed-out health call by now.
        await server.async_engine.call(lambda engine: None)

    try:
        asyncio.run(scenario())
    finally:
        release.set()
    assert server.async_engine.failure is None
    assert server.health() == 200
    r = server.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 1})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "prompt", [[[1, 2], "text"], ["text", [1, 2]], [[1, 2], [-1.5]], [[1], 5], [None], [[]], [""]]
)
def test_a_mixed_or_malformed_batch_is_a_400_on_its_prompt(server: BoundsServer, prompt: Any) -> None:
    """A batch is validated as the kind its first prompt is (one pass, not one per kind of prompt)."""
    r = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert str(r.json()["error"]["param"]).startswith("prompt"), r.text
