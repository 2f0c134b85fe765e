"""WriteBehind: the bounded queue between the engine thread and a lower tier's writer thread; and
WriteBehindTier, the base of the tiers that write through one (disk, Redis).

The engine thread `put`s a copy of a block and returns at once; one worker thread hands batches of
queued blocks to the tier's `write` function. Invariants:
- Bounded: the bytes of the blocks queued (being written included) never exceed `max_bytes`; a `put`
  that would exceed it, or of a block over `max_item_bytes`, is dropped and counted in `dropped`.
- Every block accepted is counted once: in `written` when its `write` returned True, in `dropped` when
  it returned False or raised, or when the queue dropped it (closed while held back).
- A block stays findable (`holds`, `get`) from its `put` until its write has finished, so a tier that
  records the block as stored inside `write` never has a moment when it holds the block nowhere.
- A worker error does not stop the worker: a `write` that raises drops its batch (logged, counted) and
  the worker takes the next one.
- While `held_until()` is in the future (a remote tier backing off), nothing is written; `flush` then
  drops what is queued instead of waiting, and so does `close`.
- `close` drains: it returns once every block accepted has been written or dropped and the worker has
  stopped; a `put` after it is ignored.
"""

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence

import torch

from kvserve.cache.tiers import BlockRecord, LatencyHistogram, TierUsage

log = logging.getLogger("kvserve.cache")

Block = tuple[BlockRecord, torch.Tensor]


def _nbytes(kv: torch.Tensor) -> int:
    return kv.numel() * kv.element_size()


def _never() -> float:
    return 0.0


class WriteBehind:
    def __init__(
        self,
        name: str,
        write: Callable[[list[Block]], bool],
        max_bytes: int,
        *,
        batch_size: int = 1,
        max_item_bytes: int | None = None,
        held_until: Callable[[], float] = _never,
    ) -> None:
        """`write(batch)` stores a batch of up to `batch_size` blocks on the worker thread and says whether
        it succeeded; `held_until()` is a time (time.monotonic) before which no write is tried."""
        self.name = name
        self.max_bytes = max_bytes
        self.batch_size = batch_size
        self.max_item_bytes = max_bytes if max_item_bytes is None else max_item_bytes
        self._write = write
        self._held_until = held_until
        self._lock = threading.Condition()
        self._pending: dict[bytes, Block] = {}
        self._queue: deque[bytes] = deque()
        self._queued_bytes = 0
        self._writing = 0
        self._closed = False
        self.written = self.dropped = 0
        self.latency = LatencyHistogram()
        self._worker = threading.Thread(target=self._run, name=f"kvserve-{name}-writer", daemon=True)
        self._worker.start()

    @property
    def queued_bytes(self) -> int:
        with self._lock:
            return self._queued_bytes

    def put(self, record: BlockRecord, kv: torch.Tensor) -> None:
        """Queue `kv` (owned by the queue from now on) to be written under `record`, unless it is queued
        already or the queue is closed; drop it (counted) if it does not fit."""
        size = _nbytes(kv)
        with self._lock:
            if self._closed or record.key in self._pending:
                return
            if self._queued_bytes + size > self.max_bytes or size > self.max_item_bytes:
                self.dropped += 1
                return
            self._pending[record.key] = (record, kv)
            self._queue.append(record.key)
            self._queued_bytes += size
            self._lock.notify_all()

    def holds(self, key: bytes) -> bool:
        with self._lock:
            return key in self._pending

    def first(self, keys: Sequence[bytes]) -> int | None:
        """The index of the first of `keys` queued, or None (one lock for them all)."""
        with self._lock:
            return next((i for i, key in enumerate(keys) if key in self._pending), None)

    def get(self, key: bytes) -> Block | None:
        """The queued block under `key` (not to be changed: clone it to use it), or None."""
        with self._lock:
            return self._pending.get(key)

    def _held(self) -> bool:
        return time.monotonic() < self._held_until()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._closed and (not self._queue or self._held()):
                    wait = self._held_until() - time.monotonic() if self._queue else None
                    self._lock.wait(timeout=wait)
                if not self._queue:
                    return
                if self._held():
                    # Closing while held back: what is queued is dropped, not waited for.
                    self._drop_queue()
                    return
                keys = [self._queue.popleft() for _ in range(min(self.batch_size, len(self._queue)))]
                batch = [self._pending[k] for k in keys]
                self._writing = len(keys)
            started = time.monotonic()
            try:
                ok = self._write(batch)
            except Exception:
                log.warning("%s tier: writing %d blocks failed", self.name, len(batch), exc_info=True)
                ok = False
            elapsed = time.monotonic() - started
            with self._lock:
                for key, (_, kv) in zip(keys, batch, strict=True):
                    del self._pending[key]
                    self._queued_bytes -= _nbytes(kv)
                if ok:
                    self.written += len(keys)
                else:
                    self.dropped += len(keys)
                self._writing = 0
                self._lock.notify_all()
            if ok:
                for _ in keys:
                    self.latency.observe(elapsed / len(keys))

    def _drop_queue(self) -> None:
        """Drop every block not being written (caller holds the lock)."""
        self.dropped += len(self._queue)
        for key in self._queue:
            self._queued_bytes -= _nbytes(self._pending.pop(key)[1])
        self._queue.clear()

    def flush(self) -> None:
        """Wait until every queued block is written, or dropped because writing is held back."""
        with self._lock:
            while (self._queue or self._writing) and self._worker.is_alive():
                if self._queue and not self._writing and self._held():
                    self._drop_queue()
                    return
                self._lock.wait(timeout=0.1)

    def close(self) -> None:
        """Write (or, while held back, drop) what is queued, then stop the worker."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._worker.join()


def payload_bytes(kv: torch.Tensor) -> memoryview:
    """The block's KV as raw bytes, in `KVCache.read_block`'s layout: what a tier seals and stores."""
    return kv.contiguous().reshape(-1).view(torch.uint8).numpy().data


class WriteBehindTier(ABC):
    """What the disk and Redis tiers share: stores written behind by a `WriteBehind` queue, the counters,
    `flush`, `usage` and `close`. A subclass names itself (`name`), writes a batch on the writer thread
    (`_write_batch`, which says whether it succeeded) and reports what it holds (`_occupancy`); it keeps
    its own state under `_lock`, which also guards the counters.

    A block stays findable from its `store` until its write has finished: `_queued_copy` serves it
    meanwhile, and a subclass that records the block as stored inside `_write_batch` never holds it
    nowhere (write_behind.py's invariants).
    """

    name: str

    def __init__(
        self,
        queue_bytes: int,
        *,
        batch_size: int = 1,
        max_item_bytes: int | None = None,
        held_until: Callable[[], float] = _never,
    ) -> None:
        self._lock = threading.Lock()
        self.loads = self.loads_failed = 0
        # Blocks looked for and not found, and calls that failed (a remote tier's; see TierUsage).
        self.misses = self.errors = 0
        self.load_latency = LatencyHistogram()
        self._writes = WriteBehind(
            self.name,
            self._write_batch,
            queue_bytes,
            batch_size=batch_size,
            max_item_bytes=max_item_bytes,
            held_until=held_until,
        )

    @abstractmethod
    def _write_batch(self, batch: list[Block]) -> bool:
        """Store `batch` (the writer thread's work); whether it succeeded."""

    @abstractmethod
    def _occupancy(self) -> tuple[int, int, int]:
        """(blocks held, bytes used, capacity in bytes); called under `_lock`."""

    def store(self, record: BlockRecord, kv: torch.Tensor) -> None:
        self._writes.put(record, kv)

    def _queued_copy(
        self, record: BlockRecord, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor | None:
        """A copy of the block queued under `record`'s key and not written yet, if it is exactly `record`'s
        block of this shape and dtype; None otherwise."""
        pending = self._writes.get(record.key)
        if pending is None:
            return None
        queued_record, kv = pending
        if queued_record != record or tuple(kv.shape) != shape or kv.dtype != dtype:
            return None
        return kv.clone()

    def flush(self) -> None:
        """Wait until every queued block is written, or dropped because writing is held back."""
        self._writes.flush()

    def usage(self) -> TierUsage:
        with self._lock:
            num_blocks, bytes_used, capacity_bytes = self._occupancy()
            return TierUsage(
                name=self.name,
                num_blocks=num_blocks,
                bytes_used=bytes_used,
                capacity_bytes=capacity_bytes,
                stores=self._writes.written,
                stores_dropped=self._writes.dropped,
                loads=self.loads,
                loads_failed=self.loads_failed,
                load_latency=self.load_latency.snapshot(),
                store_latency=self._writes.latency.snapshot(),
                misses=self.misses,
                errors=self.errors,
            )

    def close(self) -> None:
        """Write (or, while held back, drop) what is queued, then stop the writer."""
        self._writes.close()
