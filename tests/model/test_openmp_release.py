"""Releasing a thread's OpenMP workers (kvserve.model.openmp), as the server's main thread does once the
engine thread takes over the steps.

Workers are told apart by thread id: the ids that appear while a thread runs its first parallel region.
Counting the process's threads instead made the tests depend on other tests' threads exiting meanwhile."""

import os
import threading
import time
from collections.abc import Callable

import pytest
import torch

from kvserve.model import openmp

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="finds threads through /proc")


def _thread_ids() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _parallel_sum(scale: float) -> float:
    # Large enough for torch to split it across the calling thread's OpenMP workers.
    return float((torch.ones(1 << 22) * scale).sum().item())


def _started_workers() -> set[int]:
    """The worker threads that the calling thread's first parallel region starts."""
    before = _thread_ids()
    assert _parallel_sum(2.0) == 2.0 * (1 << 22)
    return _thread_ids() - before


def _eventually(condition: Callable[[], bool]) -> bool:
    """Whether `condition` holds within two seconds (exiting threads take a moment)."""
    deadline = time.monotonic() + 2
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_thread_releases_the_workers_its_parallel_regions_started() -> None:
    workers: set[int] = set()
    released: list[bool] = []
    gone: list[bool] = []

    def work() -> None:
        torch.set_num_threads(2)
        workers.update(_started_workers())
        released.append(openmp.release_thread_pool())
        gone.append(_eventually(lambda: not workers & _thread_ids()))

    previous = torch.get_num_threads()
    try:
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(previous)
    if not released[0]:
        pytest.skip("this OpenMP runtime cannot release its threads")
    assert workers
    assert gone == [True]


def test_a_release_leaves_other_threads_workers_alone() -> None:
    """A thread with no workers of its own (the server's main thread when the model loaded elsewhere)
    releases nothing of another thread's pool: that pool's workers stay, and its regions still compute."""
    workers: set[int] = set()
    ready, go, done = threading.Event(), threading.Event(), threading.Event()
    after: list[float] = []

    def owner() -> None:
        torch.set_num_threads(2)
        workers.update(_started_workers())
        ready.set()
        go.wait(10)
        after.append(_parallel_sum(3.0))
        openmp.release_thread_pool()
        done.set()

    previous = torch.get_num_threads()
    try:
        thread = threading.Thread(target=owner)
        thread.start()
        assert ready.wait(10)
        assert workers
        released: list[bool] = []
        bystander = threading.Thread(target=lambda: released.append(openmp.release_thread_pool()))
        bystander.start()
        bystander.join()
        assert released in ([True], [False])
        # Give a wrongly released pool the time its workers take to exit.
        time.sleep(0.2)
        assert workers <= _thread_ids()
        go.set()
        assert done.wait(10)
        thread.join()
    finally:
        go.set()
        torch.set_num_threads(previous)
    assert after == [3.0 * (1 << 22)]
