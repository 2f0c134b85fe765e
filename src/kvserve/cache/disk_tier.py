"""DiskTier: full KV blocks as files in one directory, written behind, verified on every load.

Layout: DIR/<first two hex digits of the key>/<key in hex>.kv. A file is

    MAGIC (8 bytes) | header length (4 bytes, little endian) | header (JSON) | payload

where the header names the format version, the model fingerprint, the namespace, the parent key, the
block's token ids, the payload's dtype, shape, size and blake2b checksum, and the payload is the block's
K and V (`KVCache.read_block`'s layout). A load checks every one of them against what the caller
expects, and recomputes the key from the header: a missing, truncated, corrupted or foreign file is
dropped with a warning and reported as a miss, never served.

Writes are atomic: a temporary file in the same folder is written, fsynced and renamed over the final
name, so `kill -9` at any moment leaves only whole files (and stray temporaries, removed at startup).
The index (key -> size, least recently used first) lives in memory and is rebuilt at startup from the
file names and sizes alone; no KV is read until a request matches it. Space is kept within
`capacity_bytes` by deleting the least recently stored or loaded files.

The engine thread only queues a copy of the block (`store`); one writer thread does the disk work. A
store that finds the queue over `queue_bytes` is dropped (counted): the block is then simply not on disk.
"""

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from typing import Any

import torch

from kvserve.cache.block_key import chain_key
from kvserve.cache.tiers import BlockRecord, LatencyHistogram, TierUsage

log = logging.getLogger("kvserve.cache")

MAGIC = b"KVSBLOCK"
VERSION = 1
_SUFFIX = ".kv"
_TMP = ".tmp"
_LENGTH_BYTES = 4
# A header holds a block's token ids and a few short fields: anything longer is not ours.
_MAX_HEADER = 1 << 20


class CorruptBlock(Exception):
    """A block file that must not be served; the message says why."""


def _checksum(payload: memoryview) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def _payload_bytes(kv: torch.Tensor) -> memoryview:
    return kv.contiguous().reshape(-1).view(torch.uint8).numpy().data


class DiskTier:
    name = "disk"

    def __init__(
        self,
        directory: str,
        capacity_bytes: int,
        fingerprint: bytes,
        queue_bytes: int = 256 * 2**20,
    ) -> None:
        self.directory = os.path.abspath(directory)
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.queue_bytes = queue_bytes
        self._lock = threading.Condition()
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._bytes_used = 0
        self._pending: dict[bytes, tuple[BlockRecord, torch.Tensor]] = {}
        self._queue: deque[bytes] = deque()
        self._queued_bytes = 0
        self._writing = False
        self._closed = False
        self.stores = self.stores_dropped = self.loads = self.loads_failed = 0
        self.load_latency = LatencyHistogram()
        self.store_latency = LatencyHistogram()
        os.makedirs(self.directory, exist_ok=True)
        started = time.monotonic()
        self._scan()
        log.info(
            "disk tier %s: %d blocks, %d bytes of %d, indexed in %.2fs",
            self.directory,
            len(self._index),
            self._bytes_used,
            capacity_bytes,
            time.monotonic() - started,
        )
        self._writer = threading.Thread(target=self._write_loop, name="kvserve-disk-writer", daemon=True)
        self._writer.start()

    def _path(self, key: bytes) -> str:
        name = key.hex()
        return os.path.join(self.directory, name[:2], name + _SUFFIX)

    def _scan(self) -> None:
        """Index every block file by name and size, oldest modification first; remove temporaries that a
        killed writer left behind."""
        found: list[tuple[float, bytes, int]] = []
        for sub in os.scandir(self.directory):
            if not sub.is_dir() or len(sub.name) != 2:
                continue
            for entry in os.scandir(sub.path):
                if entry.name.endswith(_TMP):
                    self._unlink(entry.path)
                    continue
                stem = entry.name[: -len(_SUFFIX)]
                if not entry.name.endswith(_SUFFIX) or len(stem) != 64 or not stem.startswith(sub.name):
                    continue
                try:
                    key = bytes.fromhex(stem)
                    st = entry.stat()
                except (ValueError, OSError):
                    continue
                found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes_used += size
        with self._lock:
            self._evict_over_capacity()

    @staticmethod
    def _unlink(path: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(path)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index or key in self._pending

    def store(self, record: BlockRecord, kv: torch.Tensor) -> None:
        size = kv.numel() * kv.element_size()
        with self._lock:
            if self._closed or record.key in self._index or record.key in self._pending:
                return
            if self._queued_bytes + size > self.queue_bytes or size > self.capacity_bytes:
                self.stores_dropped += 1
                return
            self._pending[record.key] = (record, kv)
            self._queue.append(record.key)
            self._queued_bytes += size
            self._lock.notify_all()

    def load(self, record: BlockRecord, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        started = time.monotonic()
        with self._lock:
            pending = self._pending.get(record.key)
            known = record.key in self._index
        if pending is not None:
            # Not written yet: the queued copy is the block itself.
            queued_record, kv = pending
            if queued_record != record or tuple(kv.shape) != shape or kv.dtype != dtype:
                return None
            self._loaded(record.key, started)
            return kv.clone()
        if not known:
            return None
        try:
            kv = self._read(record, shape, dtype)
        except (OSError, CorruptBlock) as e:
            self._drop(record.key, e)
            return None
        self._loaded(record.key, started)
        return kv

    def _loaded(self, key: bytes, started: float) -> None:
        with self._lock:
            self.loads += 1
            if key in self._index:
                self._index.move_to_end(key)
        self.load_latency.observe(time.monotonic() - started)

    def _read(self, record: BlockRecord, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        with open(self._path(record.key), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            buf = bytearray(size)
            if f.readinto(buf) != size:
                raise CorruptBlock("short read")
        view = memoryview(buf)
        head = len(MAGIC) + _LENGTH_BYTES
        if size < head or view[: len(MAGIC)] != MAGIC:
            raise CorruptBlock("not a kvserve block file")
        header_len = int.from_bytes(view[len(MAGIC) : head], "little")
        if header_len > _MAX_HEADER or head + header_len > size:
            raise CorruptBlock("truncated header")
        try:
            header: dict[str, Any] = json.loads(bytes(view[head : head + header_len]))
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptBlock("unreadable header") from e
        payload = view[head + header_len :]
        numel = 1
        for d in shape:
            numel *= d
        expected = {
            "version": VERSION,
            "fingerprint": self.fingerprint.hex(),
            "namespace": record.namespace,
            "parent": record.parent.hex(),
            "tokens": list(record.tokens),
            "dtype": str(dtype),
            "shape": list(shape),
            "payload_bytes": numel * dtype.itemsize,
        }
        if not isinstance(header, dict):
            raise CorruptBlock("unreadable header")
        for name, value in expected.items():
            if header.get(name) != value:
                raise CorruptBlock(f"{name} differs from the key's")
        if len(payload) != expected["payload_bytes"]:
            raise CorruptBlock(f"payload is {len(payload)} bytes, expected {expected['payload_bytes']}")
        if header.get("checksum") != _checksum(payload):
            raise CorruptBlock("payload checksum mismatch")
        if chain_key(self.fingerprint, record.namespace, record.parent, record.tokens) != record.key:
            raise CorruptBlock("the key does not match the header")
        flat = torch.frombuffer(buf, dtype=torch.uint8, offset=head + header_len, count=len(payload))
        return flat.view(dtype).reshape(shape)

    def _drop(self, key: bytes, reason: Exception) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes_used -= size
            self.loads_failed += 1
        self._unlink(self._path(key))
        why = "missing" if isinstance(reason, FileNotFoundError) else str(reason)
        log.warning("disk tier: dropped block %s (%s); it will be recomputed", key.hex()[:16], why)

    def _encode(self, record: BlockRecord, kv: torch.Tensor) -> tuple[bytes, memoryview]:
        payload = _payload_bytes(kv)
        header = {
            "version": VERSION,
            "fingerprint": self.fingerprint.hex(),
            "namespace": record.namespace,
            "parent": record.parent.hex(),
            "tokens": list(record.tokens),
            "dtype": str(kv.dtype),
            "shape": list(kv.shape),
            "payload_bytes": len(payload),
            "checksum": _checksum(payload),
        }
        encoded = json.dumps(header, separators=(",", ":")).encode()
        return MAGIC + len(encoded).to_bytes(_LENGTH_BYTES, "little") + encoded, payload

    def _write(self, record: BlockRecord, kv: torch.Tensor) -> int:
        path = self._path(record.key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        head, payload = self._encode(record, kv)
        tmp = f"{path}.{os.getpid()}{_TMP}"
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            self._unlink(tmp)
            raise
        return len(head) + len(payload)

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if not self._queue:
                    return
                key = self._queue.popleft()
                record, kv = self._pending[key]
                self._writing = True
            started = time.monotonic()
            try:
                size = self._write(record, kv)
            except OSError as e:
                size = -1
                log.warning("disk tier: could not write block %s: %s", key.hex()[:16], e)
            with self._lock:
                del self._pending[key]
                self._queued_bytes -= kv.numel() * kv.element_size()
                self._writing = False
                if size < 0:
                    self.stores_dropped += 1
                else:
                    self.stores += 1
                    self._index[key] = size
                    self._bytes_used += size
                    self._evict_over_capacity()
                self._lock.notify_all()
            if size >= 0:
                self.store_latency.observe(time.monotonic() - started)

    def _evict_over_capacity(self) -> None:
        """Delete least recently used files until the tier fits its capacity (caller holds the lock)."""
        while self._bytes_used > self.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._bytes_used -= size
            self._unlink(self._path(key))

    def flush(self) -> None:
        with self._lock:
            while (self._queue or self._writing) and self._writer.is_alive():
                self._lock.wait(timeout=1)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(
                name=self.name,
                num_blocks=len(self._index),
                bytes_used=self._bytes_used,
                capacity_bytes=self.capacity_bytes,
                stores=self.stores,
                stores_dropped=self.stores_dropped,
                loads=self.loads,
                loads_failed=self.loads_failed,
                load_latency=self.load_latency.snapshot(),
                store_latency=self.store_latency.snapshot(),
            )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._writer.join()
