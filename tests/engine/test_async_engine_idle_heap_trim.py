"""The engine thread returns the heap's free memory (what the steps' activations left in glibc's heaps)
once it has been idle a while after a burst of steps: once per burst, never while it has work, and
never when no step ran since the last time."""

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from kvserve.engine import async_engine as async_engine_module
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams

IDLE_S = 0.05


@dataclass
class Recorded:
    """An AsyncEngine whose releases of the free heap are recorded: each one as whether requests were
    unfinished at that moment; `released` is set at the first."""

    engine: AsyncEngine
    trims: list[bool] = field(default_factory=list)
    released: threading.Event = field(default_factory=threading.Event)


@pytest.fixture()
def recorded(make_engine: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorded]:
    engine = make_engine(kv_cache_memory=16 * 2**20, max_model_len=256)
    rec = Recorded(AsyncEngine(engine))

    def release() -> bool:
        rec.trims.append(engine.has_unfinished_requests())
        rec.released.set()
        return True

    monkeypatch.setattr(async_engine_module, "HEAP_TRIM_IDLE_S", IDLE_S)
    monkeypatch.setattr(async_engine_module, "release_free_heap", release)
    try:
        yield rec
    finally:
        rec.engine.shutdown()


async def _generate(async_engine: AsyncEngine, tokens: int) -> None:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    async for _ in async_engine.generate([1, 2, 3, 4, 5], params):
        pass


def test_the_free_heap_is_returned_once_after_a_burst_and_not_while_idle_without_steps(
    recorded: Recorded,
) -> None:
    asyncio.run(recorded.engine.ping())
    time.sleep(IDLE_S * 4)
    assert recorded.trims == [], "no step ran: there is nothing to return"

    async def burst() -> None:
        await asyncio.gather(*(_generate(recorded.engine, 8) for _ in range(3)))

    asyncio.run(burst())
    assert recorded.released.wait(timeout=30)
    time.sleep(IDLE_S * 4)
    assert recorded.trims == [False], "once, with no request unfinished"
    asyncio.run(recorded.engine.ping())
    time.sleep(IDLE_S * 4)
    assert recorded.trims == [False], "a call that runs no step returns nothing more"
