"""AsyncEngine as the server's one door: a request is checked once, a single sample streams through one
queue, and the n samples of a prompt fold into one accumulator; the server's modules reach the engine
only through the door, and no route module imports another."""

import ast
import asyncio
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

import kvserve.server
from kvserve.config import EngineConfig
from kvserve.engine import engine as engine_module
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.engine.outputs import PromptOutputs, RequestDelta
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.validation import validate_request
from kvserve.errors import InvalidRequestError
from kvserve.model.loader import LoadedModel
from kvserve.options import ServerOptions
from kvserve.server.app import create_app

SERVER = Path(kvserve.server.__file__).parent
# The modules that answer routes; app.py assembles them and is the only one that imports them.
ROUTE_MODULES = {
    "openai.serving",
    "responses.serving",
    "anthropic.serving",
    "cache_api.pins",
    "cache_api.dashboard",
}
PROMPT = list(range(100, 120))


def _engine(model: LoadedModel) -> Engine:
    return Engine.from_config(
        EngineConfig(kv_cache_memory=4 * 2**20, max_model_len=256, weight_dtype="float32"), model=model
    )


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of prompts of each call of validate_request, the one check of a request."""
    calls: list[int] = []

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(len(args[1]))
        return validate_request(*args, **kwargs)

    monkeypatch.setattr(engine_module, "validate_request", counting)
    return calls


@pytest.fixture
def url(
    tiny_model: LoadedModel, serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[str]:
    with serve_app(create_app(AsyncEngine(_engine(tiny_model)), ServerOptions())) as url:
        yield url


def test_a_chat_request_of_n_samples_is_checked_once(
    checks: list[int],
    make_tiny_engine: Callable[..., Engine],
    serve_app: Callable[[FastAPI], AbstractContextManager[str]],
) -> None:
    """It was checked seven times: once by the route, then per sample by AsyncEngine.generate and again
    by Engine.add_request. (The tiny full-vocabulary model: a chat template's role names are beyond the
    4,096-token one's vocabulary.)"""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 3, "temperature": 1.0}
    with serve_app(create_app(AsyncEngine(make_tiny_engine(max_model_len=256)), ServerOptions())) as url:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3
    assert checks == [1]


def test_a_completions_batch_is_checked_once_for_all_its_prompts(checks: list[int], url: str) -> None:
    body = {"prompt": [PROMPT, PROMPT[:10]], "max_tokens": 2, "n": 2}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4
    assert checks == [2]


def test_a_single_sample_streams_through_one_queue(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    """Every token of a stream passed through the engine's queue and then a second one, even for n = 1."""
    created: list[str] = []

    class CountingQueue(asyncio.Queue):  # type: ignore[type-arg]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            module = sys._getframe(1).f_globals.get("__name__", "")
            if module.startswith("kvserve."):
                created.append(module)

    monkeypatch.setattr(asyncio, "Queue", CountingQueue)
    body = {"prompt": PROMPT, "max_tokens": 4, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert created == ["kvserve.engine.async_engine"]


def test_a_checked_prompt_is_taken_as_proof_only_with_its_params(
    tiny_model: LoadedModel, checks: list[int]
) -> None:
    engine = _engine(tiny_model)
    params = SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=3)
    (checked,) = engine.validate_request([PROMPT], params)
    assert checked.checked_for(params) and checked.checked_for(params.for_sample(1))
    for i in range(2):
        engine.add_request(f"s{i}", checked, params.for_sample(i))
    assert checks == [1], "a sample of the checked params is not checked again"
    # Other params are checked: these ask for more than the context holds.
    too_long = SamplingParams(max_tokens=1000)
    assert not checked.checked_for(too_long)
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        engine.add_request("long", checked, too_long)
    assert checks == [1, 1]
    while engine.has_unfinished_requests():
        engine.step()


def _delta(rid: str, ids: list[int], text: str, reason: str | None, cached: int, out: int) -> RequestDelta:
    return RequestDelta(rid, ids, text, reason is not None, reason, 5, cached, out)


def test_prompt_outputs_fold_samples_and_keep_the_fewest_cached_tokens() -> None:
    outputs = PromptOutputs.start(5, 2)
    assert outputs.num_cached_tokens == 0 and not outputs.finished
    # The second sample is admitted first, after an earlier request cached 4 tokens of the prompt.
    outputs.add(1, _delta("b", [7], "x", None, 4, 1))
    assert outputs.num_cached_tokens == 4
    outputs.add(0, _delta("a", [8, 9], "yz", "length", 0, 2))
    assert not outputs.finished
    outputs.add(1, _delta("b", [10], "w", "stop", 4, 2))
    assert outputs.finished
    assert outputs.num_cached_tokens == 0
    assert outputs.num_output_tokens == 4
    assert [(s.text, s.token_ids, s.finish_reason) for s in outputs.samples] == [
        ("yz", [8, 9], "length"),
        ("xw", [7, 10], "stop"),
    ]


def test_the_server_reaches_the_engine_only_through_async_engine() -> None:
    for path in SERVER.rglob("*.py"):
        found = re.findall(r"async_engine\.engine\b|engine\.kv\b", path.read_text())
        assert not found, f"{path.name} reaches around AsyncEngine: {found}"


def test_no_route_module_imports_another() -> None:
    for name in ROUTE_MODULES:
        tree = ast.parse((SERVER / f"{name.replace('.', '/')}.py").read_text())
        imported = {
            node.module.removeprefix("kvserve.server.")
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvserve.server.")
        }
        assert not imported & (ROUTE_MODULES | {"app"}), f"{name} imports {imported & ROUTE_MODULES}"
