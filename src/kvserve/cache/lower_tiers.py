"""LowerTiers: the memory tier's view of the tiers below it (disk, then Redis), in order.

It keys blocks (chained, see block_key.py), offers newly computed blocks to every tier, and continues a
memory match with the blocks the tiers hold: `read_run` reads and verifies them into host tensors on the
calling thread (a BlockLoader's, loader.py: never the engine thread's for an admission), and `land`
copies them, on the engine thread, into memory blocks that the KVCacheManager hands it. Which tier
answered is reported only as a name, for the per-tier hit counters.

A tier that fails (raises) while a block is looked up, read ahead or loaded is a miss: `_or_miss` is
the one place that turns a tier's error into a logged miss, so no thread that reads sees it.
The tiers are thread-safe: a loader's threads read while the engine thread offers blocks and the
tiers' writer threads write.
"""

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

import torch

from kvserve.cache.block_key import ROOT, chain_key
from kvserve.cache.tiers import (
    Arrived,
    BlockIO,
    BlockRecord,
    Health,
    LowerTier,
    Prefetching,
    StateIO,
    TierUsage,
)

log = logging.getLogger("kvserve.cache")

P = ParamSpec("P")
T = TypeVar("T")


@dataclass
class LoadedBlocks:
    """The blocks a continued match loaded, in order: `blocks[i]` is the memory block that now holds the
    match's next full block, verified, and `tiers[i]` the name of the tier it came from."""

    blocks: list[int] = field(default_factory=list)
    tiers: list[str] = field(default_factory=list)


class LowerTiers:
    def __init__(
        self,
        tiers: Sequence[LowerTier],
        io: BlockIO,
        fingerprint: bytes,
        block_size: int,
        state_io: StateIO | None = None,
    ) -> None:
        """`state_io`: a hybrid model's state slots, whose checkpoints the tiers then carry too
        (tier_states.py)."""
        self.tiers = list(tiers)
        self.io = io
        self.state_io = state_io
        self.fingerprint = fingerprint
        self.block_size = block_size
        self._prefetching = [t for t in self.tiers if isinstance(t, Prefetching)]

    def extend_keys(self, keys: list[bytes], namespace: str, tokens: Sequence[int], num_blocks: int) -> None:
        """Extend `keys` (the chain keys of a sequence's first full blocks) to its first `num_blocks`."""
        bs = self.block_size
        while len(keys) < num_blocks:
            j = len(keys)
            parent = keys[-1] if keys else ROOT
            keys.append(chain_key(self.fingerprint, namespace, parent, tokens[j * bs : (j + 1) * bs]))

    def record(self, keys: Sequence[bytes], namespace: str, tokens: Sequence[int], j: int) -> BlockRecord:
        bs = self.block_size
        parent = keys[j - 1] if j else ROOT
        return BlockRecord(keys[j], parent, namespace, tuple(tokens[j * bs : (j + 1) * bs]))

    def offer(
        self,
        keys: list[bytes],
        namespace: str,
        tokens: Sequence[int],
        blocks: Sequence[int],
        start: int,
        sliding: Sequence[int] | None = None,
    ) -> None:
        """`blocks[j]` holds full block j of `tokens` (and `sliding[j]` its sliding layers' part, where
        they have blocks of their own), and blocks `start..` were just computed: every tier that lacks
        one gets a copy (written behind)."""
        self.extend_keys(keys, namespace, tokens, len(blocks))
        for j in range(start, len(blocks)):
            record = self.record(keys, namespace, tokens, j)
            missing = [t for t in self.tiers if not t.contains(record.key)]
            if not missing:
                continue
            kv = self.io.read_block(blocks[j], sliding[j] if sliding is not None else None)
            for tier in missing:
                tier.store(record, kv)

    def may_continue(self, namespace: str, tokens: Sequence[int], start: int) -> bool:
        """Whether a tier may hold full block `start` of `tokens` (the one after a memory match of `start`
        blocks): a tier that reads in batches (a remote one) may, since it knows only by reading; the
        others answer from what they index. Cheap enough for the engine thread: no tier reads here."""
        if start >= len(tokens) // self.block_size:
            return False
        if self._prefetching:
            return True
        keys: list[bytes] = []
        self.extend_keys(keys, namespace, tokens, start + 1)
        return bool(self._or_miss("looking up a KV block", self._any_holds, keys[start]))

    def read_run(
        self,
        namespace: str,
        tokens: Sequence[int],
        start: int,
        stop: Callable[[], bool],
        arrive: Callable[[str, torch.Tensor], bool],
    ) -> None:
        """Read the full blocks `start..` of `tokens` that a tier holds intact, in order, on the calling
        thread (a loader's): `arrive(tier name, verified KV)` takes each one, and says whether to go on.
        Stops at the first block that no tier holds intact or whose lookup or load fails, or once
        `stop()` is true. Touches no memory block: the caller copies the KV where it belongs."""
        end = len(tokens) // self.block_size
        if start >= end:
            return
        keys: list[bytes] = []
        if not self._or_miss("reading ahead", self._read_ahead, keys, namespace, tokens, start, end):
            return
        try:
            for j in range(start, end):
                if stop():
                    break
                if not self._or_miss("looking up a KV block", self._holds, keys, namespace, tokens, j):
                    break
                record = self.record(keys, namespace, tokens, j)
                found = self._or_miss("loading a KV block", self.fetch, record)
                if found is None or not arrive(*found):
                    break
        finally:
            self._end_read_ahead()

    def land(
        self,
        arrived: Sequence[Arrived],
        fresh_block: Callable[[], tuple[int, int | None] | None],
        landed: Callable[[int], None],
    ) -> LoadedBlocks:
        """Copy blocks read by `read_run`, in order, into memory: `fresh_block()` gives the memory block
        for each one and its sliding layers' block (None: none of their own, see `BlockIO`), or None when
        the pool is short, and landing stops there; `landed(block)` is called once it holds the KV,
        before the next `fresh_block()`."""
        loaded = LoadedBlocks()
        for tier, kv in arrived:
            fresh = fresh_block()
            if fresh is None:
                break
            block, sliding = fresh
            self.io.write_block(block, kv, sliding)
            landed(block)
            loaded.blocks.append(block)
            loaded.tiers.append(tier)
        return loaded

    @staticmethod
    def _or_miss(what: str, call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T | None:
        """`call(...)`, or None when it raises: a tier's error (its bug, an I/O error) is a logged miss."""
        try:
            return call(*args, **kwargs)
        except Exception:
            log.warning("%s in a lower tier failed; treated as a miss", what, exc_info=True)
            return None

    def _read_ahead(
        self, keys: list[bytes], namespace: str, tokens: Sequence[int], start: int, end: int
    ) -> bool:
        """Tiers that read in batches get the run of blocks `start..end` (its keys are computed now only
        for them); True once they have it, so that a failure (None from `_or_miss`) stands apart."""
        if self._prefetching:
            self.extend_keys(keys, namespace, tokens, end)
            run = [self.record(keys, namespace, tokens, j) for j in range(start, end)]
            for tier in self._prefetching:
                tier.prefetch(run, self.io.block_shape(), self.io.dtype)
        return True

    def _end_read_ahead(self) -> None:
        for tier in self._prefetching:
            tier.prefetch([], self.io.block_shape(), self.io.dtype)

    def _holds(self, keys: list[bytes], namespace: str, tokens: Sequence[int], j: int) -> bool:
        self.extend_keys(keys, namespace, tokens, j + 1)
        return self._any_holds(keys[j])

    def _any_holds(self, key: bytes) -> bool:
        return any(t.contains(key) for t in self.tiers)

    def fetch(self, record: BlockRecord) -> tuple[str, torch.Tensor] | None:
        """(tier name, verified KV) from the first tier that has the block intact, or None."""
        shape, dtype = self.io.block_shape(), self.io.dtype
        for tier in self.tiers:
            if tier.contains(record.key):
                kv = tier.load(record, shape, dtype)
                if kv is not None:
                    return tier.name, kv
        return None

    def usage(self) -> list[TierUsage]:
        return [t.usage() for t in self.tiers]

    def down(self) -> bool:
        """Whether a tier is down now (a remote one whose calls fail)."""
        return any(t.down() for t in self.tiers if isinstance(t, Health))

    def flush(self) -> None:
        for tier in self.tiers:
            tier.flush()

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
