"""Regression: loads from the lower tiers ran on the engine thread, a budget per admission, and a step
admits many requests. With a Redis that answers just under its timeout (`CLIENT PAUSE 450`, over and
over), 16 admissions in one step stalled another tenant's stream for 17 s and /health answered 503.

Loads now run on a loader's threads while the steps go on. Checked by order of events, never by time:
after 16 requests of one tenant arrive whose blocks are in a paused Redis, another tenant's stream keeps
getting tokens and the engine keeps answering its health pings before any of the 16 has a token; and
every reply equals a no-cache engine's."""

import asyncio
import threading
from collections.abc import Callable, Iterator

import pytest

from kvserve.cache.loader import LOAD_BUDGET_S
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.model.loader import LoadedModel
from tests.harness import engine_with_blocks, greedy
from tests.redis_server import RedisServer

pytestmark = pytest.mark.usefixtures("one_thread")

SECRET = bytes(range(32))
BLOCK = 4
# 16 prompts of 16 blocks each: two MGETs of 8 blocks apiece, each held by the pause.
PROMPTS = [[100 + (p * 53 + i * 7) % 3900 for i in range(65)] for p in range(16)]
STREAM = [3000 + i for i in range(9)]


def _engine(model: LoadedModel, url: str | None) -> Engine:
    engine = engine_with_blocks(
        model,
        400,
        BLOCK,
        attention="torch",
        enable_prefix_caching=url is not None,
        kv_remote=url,
        secret=SECRET,
        max_num_seqs=32,
        max_num_batched_tokens=4096,
    )
    engine.kv.tiers.set_budget(LOAD_BUDGET_S)
    return engine


def _generate_all(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, greedy(max_tokens))
    out: list[list[int]] = [[] for _ in prompts]
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out[int(delta.request_id[1:])] += delta.token_ids
    return out


@pytest.fixture
def paused_redis(redis_server: RedisServer) -> Iterator[Callable[[], None]]:
    """A Redis that pauses every client for 450 ms over and over once the returned function is called:
    each read answers, just under the tier's 0.5 s timeout, so the tier sees it slow, not down. The
    function returns once the first pause is in effect: a read issued before it would answer at once
    (the race that let the first of the 16 through in CI)."""
    start, paused, stop = threading.Event(), threading.Event(), threading.Event()

    def pause() -> None:
        client = redis_server.client()
        try:
            start.wait()
            while not stop.is_set():
                client.client_pause(450)
                paused.set()
                stop.wait(0.45)
        finally:
            client.client_unpause()
            client.close()

    def begin() -> None:
        start.set()
        assert paused.wait(10)

    thread = threading.Thread(target=pause, daemon=True)
    thread.start()
    yield begin
    stop.set()
    start.set()
    thread.join(timeout=10)


def test_a_paused_redis_never_stalls_another_tenants_stream(
    tiny_model: LoadedModel, redis_server: RedisServer, paused_redis: Callable[[], None]
) -> None:
    plain = _engine(tiny_model, None)
    want = _generate_all(plain, PROMPTS, 2)
    # Another replica computed the 16 prompts: their blocks are in Redis.
    writer = _engine(tiny_model, redis_server.url)
    try:
        assert _generate_all(writer, PROMPTS, 2) == want
        writer.kv.flush()
    finally:
        writer.close()
    async_engine = AsyncEngine(_engine(tiny_model, redis_server.url))
    events: list[str] = []

    async def stream() -> None:
        async for delta in async_engine.generate(STREAM, greedy(400), tenant="a"):
            events.extend("a" for _ in delta.token_ids)

    async def one(i: int) -> list[int]:
        out: list[int] = []
        async for delta in async_engine.generate(PROMPTS[i], greedy(2), tenant="b"):
            if not out:
                events.append("b")
            out += delta.token_ids
        return out

    async def pings(done: asyncio.Event) -> None:
        while not done.is_set():
            await async_engine.ping()
            events.append("ping")

    async def scenario() -> list[list[int]]:
        running = asyncio.ensure_future(stream())
        while "a" not in events:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(paused_redis)
        events.append("submitted")
        burst = asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
        done = asyncio.Event()
        pinging = asyncio.ensure_future(pings(done))
        got = await burst
        done.set()
        await pinging
        running.cancel()
        return got

    try:
        got = asyncio.run(scenario())
        assert async_engine.failure is None
    finally:
        async_engine.shutdown()
    assert got == want
    window = events[events.index("submitted") : events.index("b")]
    # The old engine admitted the 16 in one step that waited for every load: the stream got one token
    # and the engine answered at most one ping before the first of them had its token.
    assert window.count("a") >= 4, window
    assert window.count("ping") >= 3, window
