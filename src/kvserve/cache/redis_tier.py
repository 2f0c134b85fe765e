"""RedisTier: full KV blocks in a Redis server that several replicas share, sealed, written behind.

Keys. A block's Redis key is `kvserve:` + hex(HMAC-SHA256(name key, chain key)): the chain key is the
disk tier's (model fingerprint, namespace, parent key, token ids; block_key.py), hashed once more with a
key derived from the shared tenant secret, so that someone who can list Redis cannot confirm a guessed
prompt from the key names. Replicas started with the same secret and model compute the same names; the
model's fingerprint is in the chain key, so the tier itself needs no more than the secret.

Values. `MAGIC | version (1 byte) | dtype (1 byte length + ASCII) | ndim (1 byte) | shape (4 bytes
each, little endian) | nonce | ciphertext | tag`: the payload, the block's K and V
(`KVCache.read_block`'s layout), is encrypted and authenticated with AES-256-GCM, the key name and the
header as associated data (block_seal.py). No token id is stored, and without the secret the KV can be
neither read (whoever has the model would get the prompt back from it) nor forged. Both keys are
derived from the shared secret (never the secret itself), one per use.

Reads are bounded before any payload crosses the socket: the size of a block's value is known from
the shape and dtype alone, and each key is read with STRLEN and GETRANGE up to that size, in one
pipeline. A value of any other size (an old format, a value some other writer put there, however big)
is refused without being read; one of the right size is opened. Anything that is not what this replica
would have written under that name is refused (a warning, counted in `loads_failed`), never served.

A hybrid model's state checkpoints (tier_states.py) are values of the same form under their own keys,
with STATE_MAGIC and the state layout in the header: `find` asks for many at once (one pipelined
EXISTS), and `load` reads the one chosen with one bounded read.

Loads happen off the engine thread, on a BlockLoader's threads (loader.py): `prefetch` names the run of
blocks that would continue a prompt's memory match, and the first `contains` of a block of that run, on
the same thread, reads it and the next few with one pipelined read (chunks: one huge read of a long
prompt is slow and holds Redis' single thread).
Stores are queued (bounded by bytes; over the bound a block is dropped, counted) and one writer thread
sends them as pipelined SETs (write_behind.py). `usage` reports the keys in Redis' database (all of
them, as of the last write: Redis is shared) as its blocks, and the write queue as its bytes and
capacity: Redis' own memory is bounded by Redis (`maxmemory`).

Failures. Every call has a socket timeout and a connect timeout and no retry of its own. A failed call
(down, slow, reset) is counted in `errors`, logged at most once per LOG_INTERVAL_S, and opens a back-off
window (doubling up to MAX_BACKOFF_S) during which the tier answers every load with a miss without
touching the network and the writer waits; the first call after the window reconnects. An admission
stops reading once its reads have taken `admission_budget_s` (Redis slow but answering), and its loader
job has a budget of its own: no step waits for Redis, and a request never fails because of it. A flushed or
evicted key is an ordinary miss (`misses`). Memory in Redis is bounded by Redis itself: run it with
`maxmemory` and `maxmemory-policy allkeys-lru`.
"""

import hashlib
import hmac
import logging
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvserve.cache.block_seal import BlockSeal, Unsealable, sealed_size
from kvserve.cache.tiers import TIER_REDIS, BlockRecord
from kvserve.cache.write_behind import Block, WriteBehindTier, payload_bytes
from kvserve.secret import REDIS_KEY_NAMES_PURPOSE, REDIS_VALUE_SEAL_PURPOSE, derive_key

log = logging.getLogger("kvserve.cache")

MAGIC = b"KVSR"
# A hybrid model's state checkpoint (tier_states.py): a magic of its own, the layout after the shape.
STATE_MAGIC = b"KVSS"
# 2: sealed (AES-256-GCM); 1 was MAC'd, its values are refused (their size and header differ).
VERSION = 2
KEY_PREFIX = b"kvserve:"
# Blocks read by one pipelined read: a few MiB of float32 KV for a small model; enough to amortize the
# round trip.
CHUNK_BLOCKS = 8
# Blocks sent by one pipelined write.
WRITE_BATCH = 16
LOG_INTERVAL_S = 10.0
MIN_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0


def value_header(shape: tuple[int, ...], dtype: torch.dtype, layout: bytes | None = None) -> bytes:
    """The clear header of every value of blocks of this shape and dtype (of state checkpoints of this
    `layout`)."""
    dtype_name = str(dtype).encode()
    return (
        (MAGIC if layout is None else STATE_MAGIC)
        + bytes([VERSION, len(dtype_name)])
        + dtype_name
        + bytes([len(shape)])
        + struct.pack(f"<{len(shape)}I", *shape)
        + (layout or b"")
    )


def _payload_size(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    size = dtype.itemsize
    for d in shape:
        size *= d
    return size


def _wrong_type(reply: object) -> bool:
    """A key that holds something other than a string (a list, a set): that key's value is bad, not the
    call."""
    return isinstance(reply, redis.ResponseError) and str(reply).startswith("WRONGTYPE")


class _RateLimitedLog:
    """One warning per kind per interval; the rest are counted and reported with the next one."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(kind, -self.interval_s) < self.interval_s:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                return
            self._last[kind] = now
            suppressed = self._suppressed.pop(kind, 0)
        more = f" ({suppressed} more like it since the last report)" if suppressed else ""
        log.warning("redis tier: " + message + more, *args)


@dataclass
class _Run:
    """One admission's run of blocks, as the thread loading it reads them: `records[:read_upto]` have
    been read (`spent_s` seconds in all), and those found intact wait in `staged` until loaded."""

    records: list[BlockRecord] = field(default_factory=list)
    index: dict[bytes, int] = field(default_factory=dict)
    read_upto: int = 0
    spent_s: float = 0.0
    staged: dict[bytes, torch.Tensor] = field(default_factory=dict)
    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32


class RedisTier(WriteBehindTier):
    name = TIER_REDIS

    def __init__(
        self,
        url: str,
        secret: bytes,
        *,
        queue_bytes: int = 256 * 2**20,
        timeout_s: float = 0.5,
        connect_timeout_s: float = 0.5,
        chunk_blocks: int = CHUNK_BLOCKS,
        admission_budget_s: float = 1.0,
    ) -> None:
        if len(secret) < 16:
            raise ValueError("the redis tier needs the shared tenant secret (16 bytes or more)")
        self.chunk_blocks = chunk_blocks
        self.admission_budget_s = admission_budget_s
        self._name_key = derive_key(secret, REDIS_KEY_NAMES_PURPOSE)
        self._seal = BlockSeal(derive_key(secret, REDIS_VALUE_SEAL_PURPOSE))
        # No retries inside redis-py: the tier's own back-off decides when to try again.
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
        )
        # Keys in Redis' database, as of the last write (DBSIZE, read by the writer): for `usage`.
        self._db_keys = 0
        self._backoff_s = 0.0
        self._down_until = 0.0
        # Each thread's run of blocks (a loader thread's admission, or the engine thread's pin): one
        # thread's reads never see another's run, so no read waits for another's.
        self._local = threading.local()
        self._log = _RateLimitedLog()
        # While Redis is down (the back-off window) the writer waits, and a flush or close drops.
        super().__init__(queue_bytes, batch_size=WRITE_BATCH, held_until=lambda: self._down_until)
        log.info("redis tier %s", self._safe_url())

    def _safe_url(self) -> str:
        """The URL without its password, for logs."""
        kwargs = self._client.connection_pool.connection_kwargs
        return f"redis://{kwargs.get('host')}:{kwargs.get('port')}/{kwargs.get('db', 0)}"

    def redis_key(self, key: bytes) -> bytes:
        return KEY_PREFIX + hmac.new(self._name_key, key, hashlib.sha256).hexdigest().encode()

    # Health: a failed call opens a back-off window; a successful one closes it.

    def _available(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._down_until

    def down(self) -> bool:
        return not self._available()

    def _failed(self, what: str, error: Exception) -> None:
        with self._lock:
            self.errors += 1
            self._backoff_s = min(MAX_BACKOFF_S, max(MIN_BACKOFF_S, 2 * self._backoff_s))
            self._down_until = time.monotonic() + self._backoff_s
            backoff = self._backoff_s
        self._log.warning(
            "error",
            "%s failed (%s: %s); misses for %.1fs, then reconnecting",
            what,
            type(error).__name__,
            error,
            backoff,
        )

    def _succeeded(self) -> None:
        with self._lock:
            if self._backoff_s:
                log.info("redis tier: %s answers again", self._safe_url())
            self._backoff_s = 0.0
            self._down_until = 0.0

    # Values.

    def encode(self, record: BlockRecord, kv: torch.Tensor) -> bytearray:
        header = value_header(tuple(kv.shape), kv.dtype, record.layout)
        return self._seal.seal(self.redis_key(record.key), header, payload_bytes(kv))

    def value_size(self, shape: tuple[int, ...], dtype: torch.dtype, layout: bytes | None = None) -> int:
        """The size of every value of a block of this shape and dtype: no other size is ever read."""
        return sealed_size(value_header(shape, dtype, layout), _payload_size(shape, dtype))

    def decode(
        self,
        name: bytes,
        value: bytes,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        layout: bytes | None = None,
    ) -> torch.Tensor:
        """The block's KV (a state checkpoint's bytes, with its `layout`) from a value read under `name`;
        raises Unsealable unless it is exactly what this replica would have written there."""
        header = value_header(shape, dtype, layout)
        payload = self._seal.open(name, header, value, _payload_size(shape, dtype))
        return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).reshape(shape)

    # LowerTier.

    def _run(self) -> _Run:
        """The calling thread's run (an empty one outside an admission)."""
        run: _Run | None = getattr(self._local, "run", None)
        if run is None:
            run = self._local.run = _Run()
        return run

    def prefetch(self, records: Sequence[BlockRecord], shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """The blocks that would continue an admission's memory match, in order: `contains` on the same
        thread reads them from Redis by chunks as it reaches them. An empty run ends the admission (drops
        what was read and not loaded)."""
        records = list(records)
        self._local.run = _Run(records, {r.key: i for i, r in enumerate(records)}, shape=shape, dtype=dtype)

    def contains(self, key: bytes) -> bool:
        run = self._run()
        if key in run.staged or self._writes.holds(key):
            return True
        i = run.index.get(key)
        if i is None:
            # Outside an admission: a block just computed is offered. It was not found at its admission
            # (or not looked for), so it is written, whatever this replica wrote before: Redis may have
            # lost it (flushed, restarted, evicted) in between.
            return False
        if i >= run.read_upto:
            self._read_chunk(run, i)
        return key in run.staged

    def _read_chunk(self, run: "_Run", start: int) -> None:
        records = run.records[start : start + self.chunk_blocks]
        run.read_upto = start + len(records)
        if not self._available() or run.spent_s > self.admission_budget_s:
            # Down, or this admission has waited its share: the rest of the prompt is computed.
            with self._lock:
                self.misses += len(records)
            return
        names = [self.redis_key(r.key) for r in records]
        expected = self.value_size(run.shape, run.dtype)
        started = time.monotonic()
        try:
            values = self._read_bounded(names, expected)
        except redis.RedisError as e:
            run.spent_s += time.monotonic() - started
            self._failed(f"reading {len(names)} blocks", e)
            with self._lock:
                self.misses += len(records)
            return
        self._succeeded()
        elapsed = time.monotonic() - started
        run.spent_s += elapsed
        found = 0
        for record, name, value in zip(records, names, values, strict=True):
            if value is None:
                with self._lock:
                    self.misses += 1
                continue
            try:
                if isinstance(value, Unsealable):
                    raise value
                run.staged[record.key] = self.decode(name, value, run.shape, run.dtype)
            except Unsealable as e:
                with self._lock:
                    self.loads_failed += 1
                self._log.warning("bad value", "refused block %s (%s); it will be recomputed", name[8:24], e)
                continue
            found += 1
        for _ in range(found):
            self.load_latency.observe(elapsed / found)

    def _read_bounded(self, names: list[bytes], expected: int) -> list[bytes | Unsealable | None]:
        """Each key's value if it is `expected` bytes long, None if the key is missing, or why it was
        refused unread; in one round trip (STRLEN and GETRANGE up to `expected` bytes for each key), so
        that no value bigger than a block's crosses the socket. A failed call raises."""
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.strlen(name)
            pipe.getrange(name, 0, expected - 1)
        replies = pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, redis.ResponseError) and not _wrong_type(reply):
                raise reply
        values: list[bytes | Unsealable | None] = []
        for size, value in zip(replies[::2], replies[1::2], strict=True):
            if size == 0:
                values.append(None)
            elif _wrong_type(size) or not isinstance(value, bytes):
                values.append(Unsealable("not a string, or changed into something else while read"))
            elif size != expected:
                values.append(Unsealable(f"{size} bytes, a block's value has {expected}; not read"))
            else:
                values.append(value)
        return values

    def find(self, keys: Sequence[bytes]) -> int | None:
        """One pipelined EXISTS of the keys' names (a miss while down or when it fails)."""
        queued = self._writes.first(keys)
        asked = keys if queued is None else keys[:queued]
        if not self._available() or not asked:
            return queued
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in asked:
                pipe.exists(self.redis_key(key))
            replies = pipe.execute()
        except redis.RedisError as e:
            self._failed(f"looking up {len(asked)} state checkpoints", e)
            return queued
        self._succeeded()
        return next((i for i, held in enumerate(replies) if held), queued)

    def _load_state(
        self, record: BlockRecord, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor | None:
        """A state checkpoint, read now with one bounded read (it is not part of a run of blocks)."""
        if not self._available():
            return None
        name = self.redis_key(record.key)
        try:
            (value,) = self._read_bounded([name], self.value_size(shape, dtype, record.layout))
        except redis.RedisError as e:
            self._failed("reading a state checkpoint", e)
            return None
        self._succeeded()
        if value is None:
            with self._lock:
                self.misses += 1
            return None
        try:
            if isinstance(value, Unsealable):
                raise value
            return self.decode(name, value, shape, dtype, record.layout)
        except Unsealable as e:
            with self._lock:
                self.loads_failed += 1
            self._log.warning("bad value", "refused state %s (%s); it will be recomputed", name[8:24], e)
            return None

    def load(self, record: BlockRecord, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        kv = self._run().staged.pop(record.key, None)
        if kv is None:
            kv = self._queued_copy(record, shape, dtype)
        if kv is None and record.layout is not None:
            kv = self._load_state(record, shape, dtype)
        if kv is None or tuple(kv.shape) != shape or kv.dtype != dtype:
            return None
        with self._lock:
            self.loads += 1
        return kv

    def _write_batch(self, batch: list[Block]) -> bool:
        """SETs the batch in one round trip (the writer thread's work) and reads how many keys Redis
        holds after it; False on failure."""
        try:
            pipe = self._client.pipeline(transaction=False)
            for record, kv in batch:
                pipe.set(self.redis_key(record.key), self.encode(record, kv))
            pipe.dbsize()
            replies = pipe.execute()
        except redis.RedisError as e:
            self._failed(f"writing {len(batch)} blocks", e)
            return False
        self._succeeded()
        with self._lock:
            self._db_keys = int(replies[-1])
        return True

    def _occupancy(self) -> tuple[int, int, int]:
        return self._db_keys, self._writes.queued_bytes, self._writes.max_bytes

    def close(self) -> None:
        super().close()
        self._client.close()
