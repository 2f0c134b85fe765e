"""The interface of the cache tiers below memory (disk, and Redis shared by replicas).

Memory is the first tier: the BlockPool and the PrefixCache. A lower tier keeps copies of full blocks
under chained keys (`block_key.py`) and gives them back verified, or not at all. LowerTiers
(`lower_tiers.py`) is the only caller, for the KVCacheManager: it offers every newly published block to
each lower tier, and before an admission it continues the memory match below memory, reading the blocks
it finds on a loader's thread (`loader.py`); the manager copies them into fresh memory blocks. Above
the manager nobody knows which tier a block came from; only the hit counters are kept per tier.
"""

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from kvserve.model.recurrent import StateSpec

# Every tier's name, once: hit counters, metrics labels and `GET /v1/cache` all show these.
TIER_MEMORY = "memory"
TIER_DISK = "disk"
TIER_REDIS = "redis"

# Seconds; the upper bounds of the latency histograms of every tier.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


# A block read from a lower tier: the tier's name and the block's verified KV.
Arrived = tuple[str, torch.Tensor]


@dataclass(frozen=True)
class BlockRecord:
    """What identifies one stored block: the chained key, its parent's key, the namespace and the block's
    exact token ids. A tier stores only the key (the rest would reveal the prompt): on load it recomputes
    the key from the rest, and the stored block's seal binds the key (block_seal.py)."""

    key: bytes
    parent: bytes
    namespace: str
    tokens: tuple[int, ...]
    # None: a KV block. Otherwise the value is a hybrid model's recurrent-state checkpoint after
    # `tokens` past the parent's block (0 to block_size - 1 of them), of this state layout (a digest of
    # its tensors' shapes and dtypes): its bytes as one flat uint8 tensor (`StateIO`'s order).
    layout: bytes | None = None


@dataclass(frozen=True)
class LatencySnapshot:
    """Cumulative counts per bucket (Prometheus' convention), their sum and count."""

    buckets: tuple[float, ...]
    cumulative: tuple[int, ...]
    total: float
    count: int


class LatencyHistogram:
    """A thread-safe latency histogram; tiers record from their own threads, scrapes read snapshots."""

    def __init__(self, buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self._buckets = tuple(buckets)
        self._counts = [0] * (len(self._buckets) + 1)
        self._total = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = next((i for i, b in enumerate(self._buckets) if seconds <= b), len(self._buckets))
        with self._lock:
            self._counts[i] += 1
            self._total += seconds

    def snapshot(self) -> LatencySnapshot:
        with self._lock:
            counts, total = list(self._counts), self._total
        cumulative: list[int] = []
        running = 0
        for c in counts:
            running += c
            cumulative.append(running)
        return LatencySnapshot(self._buckets, tuple(cumulative), total, running)


@dataclass(frozen=True)
class TierUsage:
    """One lower tier's occupancy and counters, for metrics and `GET /v1/cache`."""

    name: str
    num_blocks: int
    bytes_used: int
    capacity_bytes: int
    stores: int
    stores_dropped: int
    loads: int
    loads_failed: int
    load_latency: LatencySnapshot = field(default_factory=lambda: LatencyHistogram().snapshot())
    store_latency: LatencySnapshot = field(default_factory=lambda: LatencyHistogram().snapshot())
    # Blocks looked for and not found (a remote tier's, where a lookup costs a round trip).
    misses: int = 0
    # Calls that failed (a remote tier down or slow): each one is also a miss or a dropped store.
    errors: int = 0


class LowerTier(Protocol):
    """A cache tier below memory, called from several threads at once: the engine thread offers blocks
    (`contains`, then `store`, which only queues the copy and returns at once), a loader's threads read
    them (`contains`, `load`: one bounded read of one block), and the tier's own writer writes. So its
    state is thread-safe, and a `contains` on the engine thread reads nothing."""

    name: str

    def contains(self, key: bytes) -> bool:
        """Whether the tier holds (or is about to hold) the block: a hint, `load` may still miss."""
        ...

    def store(self, record: BlockRecord, kv: torch.Tensor) -> None:
        """Keep a copy of `kv` (the tier owns it from now on); the tier may drop it when full or busy."""
        ...

    def load(self, record: BlockRecord, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The block's KV if the tier holds it intact and it is exactly `record`'s block; otherwise None,
        after dropping what it held under that key."""
        ...

    def find(self, keys: Sequence[bytes]) -> int | None:
        """The index of the first of `keys` the tier holds (or is about to), or None; a hint as
        `contains` is, read on a loader's thread (a remote tier asks in batches)."""
        ...

    def flush(self) -> None:
        """Wait until every queued store has been written (tests, shutdown)."""
        ...

    def usage(self) -> TierUsage: ...

    def close(self) -> None:
        """Write what is queued and stop; the tier is unusable afterwards."""
        ...


@runtime_checkable
class Prefetching(Protocol):
    """A lower tier that reads the blocks of one admission together (a remote one: a round trip per
    block would cost more than the block)."""

    def prefetch(self, records: Sequence[BlockRecord], shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """The blocks that would continue an admission's memory match, in order, for the calling thread's
        next `contains` and `load` calls; an empty run ends the admission."""
        ...


@runtime_checkable
class Health(Protocol):
    """A lower tier that can be down (a remote one): its calls fail for a while, and it misses."""

    def down(self) -> bool:
        """Whether the tier is down now (its last call failed and it waits before trying again)."""
        ...


class BlockIO(Protocol):
    """Reads and writes one memory block's KV (the model's KVCache), whatever its tensor layout. Where
    the sliding layers have block ids of their own, `sliding_block` is the same positions' block there;
    None writes the global layers only."""

    dtype: torch.dtype

    def read_block(self, block: int, sliding_block: int | None = None) -> torch.Tensor: ...

    def write_block(self, block: int, data: torch.Tensor, sliding_block: int | None = None) -> None: ...

    def block_shape(self) -> tuple[int, ...]: ...


class StateIO(Protocol):
    """A hybrid model's recurrent-state slots (the model's RecurrentState): the copies the StatePool
    logs, run now, and one slot read or written whole, every recurrent layer's tensors in layer order
    (`write_slot` raises, writing nothing, for a state whose tensors disagree with `specs`)."""

    specs: tuple[StateSpec | None, ...]

    def apply(self, copies: Sequence[tuple[int, int]]) -> None: ...

    def read_slot(self, slot: int) -> list[torch.Tensor]: ...

    def write_slot(self, slot: int, state: Sequence[torch.Tensor]) -> None: ...
