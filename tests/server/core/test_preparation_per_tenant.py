"""Preparation work counts against its tenant: one tenant's flood of constraints that are slow to fail
compiling cannot delay another tenant's request, which finds a preparation thread of its own while the
flood waits in its tenant's queue (server/core/preparation.py). Asserted on order and progress, never on
wall-clock times: the other tenant's request is answered while most of the flood is still in flight."""

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.model.loader import LoadedModel
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from kvserve.server.core.context import ServerContext
from kvserve.server.core.preparation import PreparationPool
from kvserve.server.http.tenants import Tenants, load_or_create_secret
from tests.hostile_grammars import overlapping_terminals

KEYS = {"flood": "key-flood-aaaa", "other": "key-other-bbbb"}
FLOOD = 36
# The flood's constraints each build 20,000 lexer states at their first token, and fail there.
FLOOD_STATES = 20_000
FLOOD_FUEL = 2_000_000


def _salt(i: int) -> str:
    """Letters that tell the flood's grammars apart: the same grammar twice would be refused at once."""
    return "".join("abcdefghijklmnopqrstuvwxyz"[int(d)] for d in str(i))


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory,
    tiny_model: LoadedModel,
    serve_app: Callable[[FastAPI], AbstractContextManager[str]],
) -> Iterator[tuple[str, ServerContext]]:
    folder = tmp_path_factory.mktemp("prepare")
    key_file = Path(folder) / "keys"
    key_file.write_text("".join(f"{name}:{key}\n" for name, key in KEYS.items()))
    tenants = Tenants(load_or_create_secret(str(folder)), key_file=str(key_file))
    config = EngineConfig(
        kv_cache_memory=32 * 2**20, grammar_max_lexer_states=FLOOD_STATES, grammar_step_lexer_fuel=FLOOD_FUEL
    )
    engine = Engine.from_config(config, model=tiny_model)
    app = create_app(AsyncEngine(engine), ServerOptions(), tenants)
    with serve_app(app) as url:
        yield url, app.state.context


def _headers(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def test_one_tenants_failing_compiles_do_not_delay_another_tenants_request(
    server: tuple[str, ServerContext],
) -> None:
    url, ctx = server
    finished: list[int] = []

    async def flood_request(client: httpx.AsyncClient, i: int) -> int:
        body = {"prompt": [100, 200], "max_tokens": 1, "guided_grammar": overlapping_terminals(salt=_salt(i))}
        r = await client.post(f"{url}/v1/completions", json=body, headers=_headers("flood"))
        finished.append(r.status_code)
        return r.status_code

    async def scenario() -> tuple[list[int], int, int, int]:
        async with httpx.AsyncClient(timeout=300) as client:
            flood = [asyncio.create_task(flood_request(client, i)) for i in range(FLOOD)]
            # Every request of the flood has arrived (some may have finished already).
            deadline = time.monotonic() + 120
            while ctx.in_flight.in_flight("flood") + len(finished) < FLOOD:
                assert time.monotonic() < deadline, "the flood never arrived"
                await asyncio.sleep(0.01)
            body = {"prompt": [100, 200, 300], "max_tokens": 1, "temperature": 0}
            r = await client.post(f"{url}/v1/completions", json=body, headers=_headers("other"))
            done_then = len(finished)
            statuses = await asyncio.gather(*flood)
            assert r.status_code == 200, r.text
            return statuses, r.status_code, done_then, ctx.in_flight.in_flight("flood")

    statuses, other_status, flood_done_then, left = asyncio.run(scenario())
    assert other_status == 200
    assert statuses == [400] * FLOOD and left == 0
    # Answered while most of the flood still waited: the flood runs two at a time in its own queue.
    assert flood_done_then < FLOOD // 2, f"{flood_done_then} of the flood finished first"


def test_a_tenant_runs_at_most_its_slots_at_once_and_a_cancelled_wait_gives_nothing_back_early() -> None:
    pool = PreparationPool(threads=4, per_tenant=2)
    running = 0
    most = 0
    lock = threading.Lock()
    release = threading.Event()

    def job() -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        release.wait(30)
        with lock:
            running -= 1
        return 1

    async def scenario() -> tuple[int, int]:
        tasks = [asyncio.create_task(pool.run("a", job)) for _ in range(6)]
        while running < 2:
            await asyncio.sleep(0.01)
        # The two running jobs' waiters are cancelled: their slots stay held until the jobs end.
        tasks[0].cancel()
        tasks[1].cancel()
        await asyncio.sleep(0.1)
        held = running
        # Another tenant is not behind tenant a's queue.
        other = await asyncio.wait_for(pool.run("b", lambda: 7), 30)
        release.set()
        results = await asyncio.gather(*tasks[2:])
        assert results == [1] * 4
        return held, other

    held, other = asyncio.run(scenario())
    assert held == 2 and other == 7 and most == 2
    deadline = time.monotonic() + 30
    while pool.busy("a") and time.monotonic() < deadline:
        time.sleep(0.01)
    pool.close()
