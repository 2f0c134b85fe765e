"""Shared fixtures: the default model is loaded once per test session and shared by every engine."""

import inspect
import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from types import CodeType, FunctionType, ModuleType
from typing import Any

import pytest
import torch
import uvicorn
from fastapi import FastAPI

from kvserve.cluster.launch import Cluster, run_until_interrupted
from kvserve.cluster.redis_process import RedisProcess
from kvserve.config import EngineConfig, default_cache_dir
from kvserve.engine.engine import Engine
from kvserve.model.loader import LoadedModel, load_model
from tests.helpers import server_process
from tests.model.family_cases import FAMILY_KINDS
from tests.redis_server import RedisServer

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    return load_model(None, default_cache_dir())


@pytest.fixture(scope="session")
def make_engine(default_model: LoadedModel) -> Callable[..., Engine]:
    """An engine on EngineConfig(**overrides) and the shared default model; small KV pool unless asked."""

    def make(**overrides: Any) -> Engine:
        overrides.setdefault("kv_cache_memory", 128 * 2**20)
        return Engine.from_config(EngineConfig(**overrides), model=default_model)

    return make


@contextmanager
def _serve(app: FastAPI) -> Iterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(
        uvicorn.Config(app, log_config=None, access_log=False, timeout_graceful_shutdown=10)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


@pytest.fixture(scope="session")
def serve_app() -> Callable[[FastAPI], AbstractContextManager[str]]:
    """`with serve_app(app) as url:` runs the app on a real uvicorn server on a free loopback port."""
    return _serve


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A tiny random Llama (2 layers, grouped-query attention, 4,096-token vocabulary) for fast engine
    tests; its token ids are a prefix of the default tokenizer's, so text streaming works as usual."""
    from tests.helpers import save_tiny_model

    path = save_tiny_model(str(tmp_path_factory.mktemp("tiny") / "llama"), "llama", vocab_size=4096)
    return load_model(path, default_cache_dir())


@pytest.fixture(scope="session")
def tiny_full_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """`tiny_model` on the default tokenizer's whole vocabulary (49,152 tokens) and a 2,048-token context,
    so that any text the default model takes encodes to ids it accepts; built once per session."""
    from tests.helpers import save_tiny_model

    folder = str(tmp_path_factory.mktemp("tiny-full-vocab") / "llama")
    path = save_tiny_model(folder, "llama", max_position_embeddings=2048)
    return load_model(path, default_cache_dir())


@pytest.fixture(scope="session")
def make_tiny_engine(tiny_full_vocab_model: LoadedModel) -> Callable[..., Engine]:
    """`make_engine` on `tiny_full_vocab_model`: for engine behaviour that does not depend on the
    model's size, at a fraction of the default model's compute."""

    def make(**overrides: Any) -> Engine:
        overrides.setdefault("kv_cache_memory", 2**24)
        return Engine.from_config(EngineConfig(**overrides), model=tiny_full_vocab_model)

    return make


@pytest.fixture(scope="session")
def tiny_q8_model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """`tiny_model` with heads of 32 (a q8_0 KV cache quantizes blocks of 32 values along a head)."""
    from tests.helpers import save_tiny_model

    path = save_tiny_model(
        str(tmp_path_factory.mktemp("tiny-q8") / "llama"), "llama", vocab_size=4096, head_dim=32
    )
    return load_model(path, default_cache_dir())


# Tiny sliding-window models: "all" slides in every layer (Mistral), "hybrid" has a global layer 0 and a
# sliding layer 1 (Qwen2's max_window_layers).
SLIDING_KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "all": ("mistral", {}),
    "hybrid": ("qwen2", {"use_sliding_window": True, "max_window_layers": 1}),
}


@pytest.fixture(scope="session")
def family_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], LoadedModel]:
    """`family_model(kind)`: a tiny random model of FAMILY_KINDS[kind] on a 4,096-token vocabulary,
    built once per session."""
    from tests.helpers import save_tiny_model

    models: dict[str, LoadedModel] = {}

    def get(kind: str) -> LoadedModel:
        if kind not in models:
            family, overrides = FAMILY_KINDS[kind]
            folder = str(tmp_path_factory.mktemp(f"family-{kind}") / family)
            path = save_tiny_model(folder, family, vocab_size=4096, **overrides)
            models[kind] = load_model(path, default_cache_dir())
        return models[kind]

    return get


@pytest.fixture(scope="session")
def sliding_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int], LoadedModel]:
    """`sliding_model(kind, window)`: a tiny random model like `tiny_model` whose layers slide over
    `window` tokens as SLIDING_KINDS[kind] says, built once per session."""
    from tests.helpers import save_tiny_model

    models: dict[tuple[str, int], LoadedModel] = {}

    def get(kind: str, window: int) -> LoadedModel:
        if (kind, window) not in models:
            family, overrides = SLIDING_KINDS[kind]
            folder = str(tmp_path_factory.mktemp(f"sliding-{kind}-{window}") / family)
            path = save_tiny_model(folder, family, vocab_size=4096, sliding_window=window, **overrides)
            models[kind, window] = load_model(path, default_cache_dir())
        return models[kind, window]

    return get


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread: with more, each small op pays a thread hand-off, and
    on a busy machine those hand-offs dominate."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """tests/browser needs selenium and Chromium (`make test-browser`): collected only under `-m browser`."""
    if collection_path.name == "browser" and config.getoption("markexpr") != "browser":
        return True
    return None


@pytest.fixture(scope="session")
def redis_session() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_server(redis_session: RedisServer) -> RedisServer:
    """The session's real redis-server, emptied for each test."""
    client = redis_session.client()
    client.flushall()
    client.close()
    return redis_session


# Tiers: `make test-fast` runs `-m "not slow"`, the unit and property tests. A test is marked slow here, at
# collection, when it reaches a server, Redis, SMG, the default model or any child process: through a
# fixture (one of SLOW_FIXTURES, or any fixture built on one), or by naming one of _SLOW_CALLS in its body,
# its fixtures or the test helpers they call. So a new test falls into its tier by what it uses;
# `@pytest.mark.slow` by hand is only for a test slow by other means.
SLOW_FIXTURES = frozenset({"default_model", "serve_app", "redis_session"})
_SLOW_CALLS: tuple[object, ...] = (
    server_process,
    RedisProcess,
    Cluster,
    run_until_interrupted,
    _serve,
    subprocess.Popen,
    subprocess.run,
    subprocess.call,
    subprocess.check_call,
    subprocess.check_output,
)
# Modules whose attributes a test names as `module.attribute` (co_names holds both names).
_OWN_CODE = ("tests", "benchmarks")
_LOOKED_INTO = (*_OWN_CODE, "subprocess")


def _names_slow_call(code: CodeType, namespace: dict[str, Any], seen: set[CodeType]) -> bool:
    """Whether `code` (with its nested functions, and the test helpers it calls) names a slow call."""
    if code in seen:
        return False
    seen.add(code)
    values = [namespace[name] for name in code.co_names if name in namespace]
    # `helpers.server_process`: the attribute's name is in co_names beside the module's.
    modules = [v for v in values if isinstance(v, ModuleType) and v.__name__.startswith(_LOOKED_INTO)]
    values += [getattr(m, name) for m in modules for name in code.co_names if hasattr(m, name)]
    for value in values:
        if any(
            value is call or (isinstance(value, type) and isinstance(call, type) and issubclass(value, call))
            for call in _SLOW_CALLS
        ):
            return True
        function = inspect.unwrap(value) if callable(value) else None
        if (
            isinstance(function, FunctionType)
            and function.__module__.startswith(_OWN_CODE)
            and _names_slow_call(function.__code__, function.__globals__, seen)
        ):
            return True
    nested = (c for c in code.co_consts if isinstance(c, CodeType))
    return any(_names_slow_call(c, namespace, seen) for c in nested)


def _fixture_functions(item: pytest.Item, names: set[str]) -> list[Any]:
    """The functions of the fixtures `names` and of every fixture they use; `names` grows to that closure."""
    manager = getattr(getattr(item, "session", None), "_fixturemanager", None)
    functions: list[Any] = []
    pending = list(names)
    while manager is not None and pending:
        for fixture in manager.getfixturedefs(pending.pop(), item) or ():
            functions.append(fixture.func)
            new = set(fixture.argnames) - names
            names |= new
            pending += new
    return functions


def is_slow(item: pytest.Item) -> bool:
    """Whether `item` belongs to the slow tier (see SLOW_FIXTURES)."""
    if item.get_closest_marker("slow") is not None:
        return True
    function = inspect.unwrap(getattr(item, "function", None) or (lambda: None))
    names = set(getattr(item, "fixturenames", ()))
    if "getfixturevalue" in function.__code__.co_names:
        # `request.getfixturevalue("name")`: the fixtures it may ask for are its string constants.
        names |= {c for c in function.__code__.co_consts if isinstance(c, str) and c.isidentifier()}
    functions = [function, *_fixture_functions(item, names)]
    if SLOW_FIXTURES.intersection(names):
        return True
    seen: set[CodeType] = set()
    return any(
        isinstance(f, FunctionType) and _names_slow_call(f.__code__, f.__globals__, seen)
        for f in map(inspect.unwrap, functions)
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if is_slow(item):
            item.add_marker(pytest.mark.slow)
