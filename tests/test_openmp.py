"""Releasing a thread's OpenMP workers (kvserve.model.openmp), as the server's main thread does once the
engine thread takes over the steps."""

import os
import threading
import time

import pytest
import torch

from kvserve.model import openmp


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settled(expected: int) -> int:
    """The process's thread count once it reaches `expected` (exiting threads take a moment), or as it
    is after two seconds."""
    deadline = time.monotonic() + 2
    while _threads() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return _threads()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_a_thread_releases_the_workers_its_parallel_regions_started() -> None:
    counts: dict[str, int] = {}
    released: list[bool] = []

    def work() -> None:
        before = _threads()
        torch.set_num_threads(2)
        # Large enough for torch to split it across the thread's OpenMP workers.
        (torch.ones(1 << 22) * 2).sum().item()
        counts["with workers"] = _threads() - before
        released.append(openmp.release_thread_pool())
        counts["after release"] = _settled(before) - before

    previous = torch.get_num_threads()
    try:
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(previous)
    if not released[0]:
        pytest.skip("this OpenMP runtime cannot release its threads")
    assert counts["with workers"] >= 1
    assert counts["after release"] == 0


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_a_release_leaves_other_threads_workers_alone() -> None:
    """A thread with no workers of its own (the server's main thread when the model loaded elsewhere)
    releases nothing of another thread's pool: the pool's workers stay, and its regions still compute."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert (torch.ones(1 << 22) * 2).sum().item() == 2 * (1 << 22)
        with_workers = _threads()
        result: list[bool] = []
        thread = threading.Thread(target=lambda: result.append(openmp.release_thread_pool()))
        thread.start()
        thread.join()
        assert result in ([True], [False])
        # Give a wrongly released pool the time its workers take to exit.
        time.sleep(0.2)
        assert _threads() == with_workers
        assert (torch.ones(1 << 22) * 3).sum().item() == 3 * (1 << 22)
        assert _threads() == with_workers
    finally:
        torch.set_num_threads(previous)
