"""DiskTier: full KV blocks as files in one private directory, written behind, sealed, verified on every
load.

Layout: DIR/<first two hex digits of the key>/<key in hex>.kv, folders 0700 and files 0600. A file is

    MAGIC (8 bytes) | header length (4 bytes, little endian) | header (JSON) | nonce | ciphertext | tag

The header names the format version, the payload's dtype, shape and size; the payload is the block's K
and V (`KVCache.read_block`'s layout), encrypted and authenticated with AES-256-GCM under a key derived
from the server secret, the block key and everything before the nonce as associated data
(block_seal.py). Without the secret a file can be neither read nor forged. Nothing in a file names its
tokens, prefix or namespace: the key (the file's name) binds them, as a hash, and the loader recomputes
the key from the request it serves, so a file is only ever found by a request that holds its tokens
already.

A load trusts nothing in the file. It opens it without following a symlink and without blocking on a
FIFO, reads it only if it is a private regular file of exactly the size this block's file has, compares
the header byte for byte with the one it would write (nothing is parsed), and opens the seal. Any
failure (a file of an older format version among them) is a miss: the file is dropped with a warning
and the block recomputed, never served, and the engine thread never sees an exception.

Writes are atomic: a temporary file in the same folder is written, fsynced and renamed over the final
name, so `kill -9` at any moment leaves only whole files (and stray temporaries, removed at startup).
The index (key -> size, least recently used first) lives in memory and is rebuilt at startup from the
file names and sizes alone; no KV is read until a request matches it. Space is kept within
`capacity_bytes` by deleting the least recently stored or loaded files. Files of other models (or
settings) may share the folder: they are indexed, and evicted, like this model's, but never found.

A hybrid model's state checkpoints (tier_states.py) are files of the same form beside the blocks, with
a magic and header of their own (STATE_MAGIC, the state layout), indexed and evicted alike.

The engine thread only queues a copy of the block (`store`); one writer thread does the disk work
(write_behind.py). A store that finds the queue over `queue_bytes` is dropped (counted): the block is
then simply not on disk.
"""

import contextlib
import json
import logging
import os
import stat
import tempfile
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from kvserve.cache.block_key import record_key
from kvserve.cache.block_seal import BlockSeal, sealed_size
from kvserve.cache.tiers import TIER_DISK, BlockRecord
from kvserve.cache.write_behind import Block, WriteBehindTier, payload_bytes
from kvserve.private_files import open_private_file, private_dir

log = logging.getLogger("kvserve.cache")

MAGIC = b"KVSBLOCK"
# A hybrid model's state checkpoint (tier_states.py): the same file format, a magic and header of its own.
STATE_MAGIC = b"KVSSTATE"
# 3: sealed (AES-256-GCM); 2 was MAC'd, its files are refused (their size and header differ).
VERSION = 3
_SUFFIX = ".kv"
_TMP = ".tmp"
_LENGTH_BYTES = 4
# Files above this size are not block files (a block of a large model is a few MB), whatever their name:
# a sparse file of a terabyte must not count against the capacity and evict everything else.
MAX_FILE_BYTES = 1 << 30


class CorruptBlock(Exception):
    """A block file that must not be served; the message says why."""


def file_layout(shape: tuple[int, ...], dtype: torch.dtype, layout: bytes | None = None) -> tuple[bytes, int]:
    """(MAGIC, the header's length and the header; the payload's size) of every file of blocks of this
    shape and dtype (of state checkpoints of this `layout`, with STATE_MAGIC): a file's first bytes are
    known before it is read."""
    payload_bytes = dtype.itemsize
    for d in shape:
        payload_bytes *= d
    header: dict[str, object] = {
        "version": VERSION,
        "dtype": str(dtype),
        "shape": list(shape),
        "payload_bytes": payload_bytes,
    }
    if layout is not None:
        header["layout"] = layout.hex()
    encoded = json.dumps(header, separators=(",", ":")).encode()
    magic = MAGIC if layout is None else STATE_MAGIC
    return magic + len(encoded).to_bytes(_LENGTH_BYTES, "little") + encoded, payload_bytes


class DiskTier(WriteBehindTier):
    name = TIER_DISK

    def __init__(
        self,
        directory: str,
        capacity_bytes: int,
        fingerprint: bytes,
        seal_key: bytes,
        queue_bytes: int = 256 * 2**20,
    ) -> None:
        """`seal_key` seals the files (derive it from the server secret: secret.derive_key)."""
        self.directory = os.path.abspath(directory)
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self._seal = BlockSeal(seal_key)
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._bytes_used = 0
        private_dir(self.directory)
        # A block larger than the whole tier is dropped, not written and evicted at once.
        super().__init__(queue_bytes, max_item_bytes=capacity_bytes)
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

    def _path(self, key: bytes) -> str:
        name = key.hex()
        return os.path.join(self.directory, name[:2], name + _SUFFIX)

    def _scan(self) -> None:
        """Index every block file by name and size, oldest modification first; remove temporaries that a
        killed writer left behind. Nothing is followed or opened: symlinks, FIFOs, folders and files too
        large to be blocks are skipped with a warning."""
        found: list[tuple[float, bytes, int]] = []
        for sub in os.scandir(self.directory):
            if len(sub.name) != 2:
                continue
            if not sub.is_dir(follow_symlinks=False):
                log.warning("disk tier: skipped %s: not a folder", sub.path)
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
                    st = entry.stat(follow_symlinks=False)
                except (ValueError, OSError):
                    continue
                if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE_BYTES:
                    log.warning("disk tier: skipped %s: not a regular file of a block's size", entry.path)
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
            if key in self._index:
                return True
        return self._writes.holds(key)

    def find(self, keys: Sequence[bytes]) -> int | None:
        with self._lock:
            indexed = next((i for i, key in enumerate(keys) if key in self._index), None)
        queued = self._writes.first(keys if indexed is None else keys[:indexed])
        return indexed if queued is None else queued

    def store(self, record: BlockRecord, kv: torch.Tensor) -> None:
        with self._lock:
            if record.key in self._index:
                return
        super().store(record, kv)

    def load(self, record: BlockRecord, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        started = time.monotonic()
        queued = self._queued_copy(record, shape, dtype)
        with self._lock:
            known = record.key in self._index
        if queued is not None:
            self._loaded(record.key, started)
            return queued
        if not known:
            return None
        try:
            kv = self._read(record, shape, dtype)
        # A load changes nothing but this tier's index, so any failure, whatever the file held, is a
        # miss: the engine thread must never stop on a file.
        except Exception as e:
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
        r = record
        if record_key(self.fingerprint, r.namespace, r.parent, r.tokens, r.layout) != r.key:
            raise CorruptBlock("the key does not match the block's tokens")
        head, payload_bytes = file_layout(shape, dtype, record.layout)
        size = sealed_size(head, payload_bytes)
        fd = open_private_file(self._path(record.key))
        try:
            found = os.fstat(fd).st_size
            if found != size:
                raise CorruptBlock(f"{found} bytes, a block's file has {size}")
            buf = bytearray(size)
            with open(fd, "rb", buffering=0, closefd=False) as f:
                done = 0
                while done < size:
                    n = f.readinto(memoryview(buf)[done:])
                    if not n:
                        raise CorruptBlock("short read")
                    done += n
        finally:
            os.close(fd)
        payload = self._seal.open(record.key, head, buf, payload_bytes)
        return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).reshape(shape)

    def _drop(self, key: bytes, reason: Exception) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes_used -= size
            self.loads_failed += 1
        self._unlink(self._path(key))
        why = "missing" if isinstance(reason, FileNotFoundError) else f"{type(reason).__name__}: {reason}"
        log.warning("disk tier: dropped block %s (%s); it will be recomputed", key.hex()[:16], why)

    def _write(self, record: BlockRecord, kv: torch.Tensor) -> int:
        path = self._path(record.key)
        folder = private_dir(self.directory, os.path.basename(os.path.dirname(path)))
        head, _ = file_layout(tuple(kv.shape), kv.dtype, record.layout)
        sealed = self._seal.seal(record.key, head, payload_bytes(kv))
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=_TMP)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(sealed)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            self._unlink(tmp)
            raise
        return len(sealed)

    def _write_batch(self, batch: list[Block]) -> bool:
        """The writer thread's work: one block to a file, then into the index (before the queue lets
        go of it, so the tier always holds it somewhere)."""
        ((record, kv),) = batch
        try:
            size = self._write(record, kv)
        except OSError as e:
            log.warning("disk tier: could not write block %s: %s", record.key.hex()[:16], e)
            return False
        with self._lock:
            self._index[record.key] = size
            self._bytes_used += size
            self._evict_over_capacity()
        return True

    def _evict_over_capacity(self) -> None:
        """Delete least recently used files until the tier fits its capacity (caller holds the lock)."""
        while self._bytes_used > self.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self._bytes_used -= size
            self._unlink(self._path(key))

    def _occupancy(self) -> tuple[int, int, int]:
        return len(self._index), self._bytes_used, self.capacity_bytes
