"""Preparation work on threads of its own, a few jobs per tenant at a time.

A request's preparation (templating, tokenizing, compiling its constraint: server/core/plan.py, /tokenize)
runs off the event loop. On the loop's shared executor, one tenant's flood of slow preparations (36
grammars that take half a second each to fail) held every worker, and another tenant's one-token request
waited behind all of them. Here each tenant runs at most `per_tenant` jobs at once on a pool of
`threads`; its further jobs wait in its own queue, never in the pool's, so another tenant's job finds a
free thread as long as fewer than threads / per_tenant tenants are busy at once.

A job's slot is given back when the job ends on its thread, not when its caller stops waiting: a client
that disconnects cannot start more jobs than its slots.
"""

import asyncio
import contextlib
import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class _Slots:
    semaphore: asyncio.Semaphore
    # Jobs of the tenant waiting for a slot or running: the entry goes when none is left.
    users: int = field(default=0)


class PreparationPool:
    """Runs preparation jobs for tenants; only the event loop calls `run` (its bookkeeping has no lock)."""

    def __init__(self, threads: int, per_tenant: int) -> None:
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="kvserve-prepare")
        self.threads = threads
        self.per_tenant = per_tenant
        self._slots: dict[str, _Slots] = {}

    async def run(self, tenant: str, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on a preparation thread once `tenant` has a free slot; its result or its exception."""
        slots = self._slots.get(tenant)
        if slots is None:
            slots = self._slots[tenant] = _Slots(asyncio.Semaphore(self.per_tenant))
        slots.users += 1
        try:
            await slots.semaphore.acquire()
        except BaseException:
            self._leave(tenant, slots)
            raise
        loop = asyncio.get_running_loop()
        try:
            job = self._executor.submit(functools.partial(fn, *args))
        except BaseException:
            self._release(tenant, slots)
            raise
        job.add_done_callback(functools.partial(self._ended, loop, tenant, slots))
        # Cancelling the wait cancels a job that has not started; one that has runs on, holding its slot.
        return await asyncio.wrap_future(job)

    def busy(self, tenant: str) -> int:
        """The tenant's jobs waiting for a slot or running."""
        slots = self._slots.get(tenant)
        return 0 if slots is None else slots.users

    def _ended(self, loop: asyncio.AbstractEventLoop, tenant: str, slots: _Slots, _: "Future[Any]") -> None:
        # On the job's thread: the bookkeeping belongs to the loop.
        # A closed loop (the server has stopped) has nothing waiting for the slot any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._release, tenant, slots)

    def _release(self, tenant: str, slots: _Slots) -> None:
        slots.semaphore.release()
        self._leave(tenant, slots)

    def _leave(self, tenant: str, slots: _Slots) -> None:
        slots.users -= 1
        if slots.users == 0 and self._slots.get(tenant) is slots:
            del self._slots[tenant]

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
