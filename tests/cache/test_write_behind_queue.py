"""WriteBehind on its own: bounded, drops counted, drains on close, a failing write does not stop it."""

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.cache.tiers import BlockRecord
from kvserve.cache.write_behind import Block, WriteBehind

WAIT_S = 30


def record(i: int) -> BlockRecord:
    return BlockRecord(i.to_bytes(32, "big"), b"", "", (i,))


def block(n: int = 4) -> torch.Tensor:
    """A block of `n` float32 values: 4 * n bytes."""
    return torch.zeros(n)


class Writer:
    """A tier's write function that records its batches, can be held at a gate, and fails on demand."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.fail: set[int] = set()
        self.raise_on: set[int] = set()
        self.seen_pending: list[bool] = []
        self.queue: WriteBehind | None = None

    def __call__(self, batch: list[Block]) -> bool:
        ids = [r.tokens[0] for r, _ in batch]
        self.started.set()
        assert self.gate.wait(WAIT_S)
        if self.queue is not None:
            self.seen_pending.append(all(self.queue.holds(r.key) for r, _ in batch))
        self.batches.append(ids)
        if self.raise_on & set(ids):
            raise RuntimeError("the tier's bug")
        return not self.fail & set(ids)

    @property
    def written(self) -> list[int]:
        """The blocks of the batches that succeeded (a failure drops its whole batch)."""
        return [i for b in self.batches if not (self.fail | self.raise_on) & set(b) for i in b]


def test_a_put_over_the_bound_is_dropped_and_counted() -> None:
    writer = Writer()
    writer.gate.clear()
    queue = WriteBehind("test", writer, max_bytes=3 * 16)
    for i in range(5):
        queue.put(record(i), block())
    assert queue.dropped == 2
    assert queue.queued_bytes == 3 * 16
    writer.gate.set()
    queue.close()
    assert sorted(writer.written) == [0, 1, 2]
    assert (queue.written, queue.dropped, queue.queued_bytes) == (3, 2, 0)


def test_a_block_over_the_item_bound_is_dropped() -> None:
    writer = Writer()
    queue = WriteBehind("test", writer, max_bytes=1000, max_item_bytes=16)
    queue.put(record(1), block(5))
    queue.put(record(2), block(4))
    queue.close()
    assert writer.written == [2]
    assert (queue.written, queue.dropped) == (1, 1)


def test_close_drains_every_queued_block_and_ignores_later_puts() -> None:
    writer = Writer()
    writer.gate.clear()
    queue = WriteBehind("test", writer, max_bytes=1 << 20, batch_size=3)
    for i in range(10):
        queue.put(record(i), block())
    queue.put(record(3), block())  # already queued: not twice
    closing = threading.Thread(target=queue.close)
    closing.start()
    writer.gate.set()
    closing.join(WAIT_S)
    assert not closing.is_alive()
    assert sorted(writer.written) == list(range(10))
    assert all(len(b) <= 3 for b in writer.batches)
    assert (queue.written, queue.dropped, queue.queued_bytes) == (10, 0, 0)
    queue.put(record(11), block())
    assert not queue.holds(record(11).key) and queue.written == 10


def test_a_block_stays_findable_until_its_write_has_finished() -> None:
    writer = Writer()
    queue = WriteBehind("test", writer, max_bytes=1 << 20)
    writer.queue = queue
    kv = torch.arange(4.0)
    queue.put(record(1), kv)
    queue.flush()
    assert writer.seen_pending == [True]
    assert not queue.holds(record(1).key) and queue.get(record(1).key) is None
    queue.close()


def test_a_failing_or_raising_write_drops_its_batch_and_the_worker_goes_on() -> None:
    writer = Writer()
    writer.fail = {1}
    writer.raise_on = {2}
    queue = WriteBehind("test", writer, max_bytes=1 << 20)
    for i in range(4):
        queue.put(record(i), block())
        queue.flush()
    assert writer.written == [0, 3]
    assert (queue.written, queue.dropped) == (2, 2)
    queue.put(record(9), block())
    queue.close()
    assert writer.written == [0, 3, 9]


def test_while_held_back_nothing_is_written_and_flush_and_close_drop() -> None:
    writer = Writer()
    until = [time.monotonic() + 3600]
    queue = WriteBehind("test", writer, max_bytes=1 << 20, held_until=lambda: until[0])
    queue.put(record(1), block())
    queue.put(record(2), block())
    queue.flush()
    assert writer.batches == [] and (queue.written, queue.dropped, queue.queued_bytes) == (0, 2, 0)
    # Released: the worker writes again once the hold is over.
    until[0] = 0.0
    queue.put(record(3), block())
    queue.flush()
    assert writer.written == [3]
    until[0] = time.monotonic() + 3600
    queue.put(record(4), block())
    queue.close()
    assert writer.written == [3] and queue.dropped == 3


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 8), max_size=30),
    batch_size=st.integers(1, 4),
    fail=st.sets(st.integers(0, 29), max_size=5),
)
def test_every_accepted_block_is_counted_once_and_the_bound_holds(
    sizes: list[int], batch_size: int, fail: set[int]
) -> None:
    writer = Writer()
    writer.fail = fail
    max_bytes = 64
    queue = WriteBehind("test", writer, max_bytes=max_bytes, batch_size=batch_size)
    for i, n in enumerate(sizes):
        queue.put(record(i), block(n))
        assert queue.queued_bytes <= max_bytes
    queue.close()
    assert queue.queued_bytes == 0
    assert queue.written + queue.dropped == len(sizes)
    assert queue.written == len(writer.written)


@pytest.mark.parametrize("held", [False, True])
def test_close_returns_with_the_worker_stopped(held: bool) -> None:
    writer = Writer()
    until = time.monotonic() + 3600 if held else 0.0
    queue = WriteBehind("test", writer, max_bytes=1 << 20, held_until=lambda: until)
    queue.put(record(1), block())
    queue.close()
    assert queue.written + queue.dropped == 1
    assert not any(t.name == "kvserve-test-writer" and t.is_alive() for t in threading.enumerate())
