"""LowerTiers: the memory tier's view of the tiers below it (disk, then Redis), in order.

It keys blocks (chained, see block_key.py), offers newly computed blocks to every tier, and continues a
memory match with the blocks the tiers hold, loading each into a memory block that the KVCacheManager
hands it. Which tier answered is reported only as a name, for the per-tier hit counters.

A tier that fails (raises) while a block is looked up, read ahead or loaded is a miss: `_or_miss` is
the one place that turns a tier's error into a logged miss, so the engine thread never sees it.
"""

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

import torch

from kvserve.cache.block_key import ROOT, chain_key
from kvserve.cache.tiers import BlockIO, BlockRecord, LowerTier, Prefetching, TierUsage

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
    def __init__(self, tiers: Sequence[LowerTier], io: BlockIO, fingerprint: bytes, block_size: int) -> None:
        self.tiers = list(tiers)
        self.io = io
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
        self, keys: list[bytes], namespace: str, tokens: Sequence[int], blocks: Sequence[int], start: int
    ) -> None:
        """`blocks[j]` holds full block j of `tokens`, and blocks `start..` were just computed: every tier
        that lacks one gets a copy (written behind)."""
        self.extend_keys(keys, namespace, tokens, len(blocks))
        for j in range(start, len(blocks)):
            record = self.record(keys, namespace, tokens, j)
            missing = [t for t in self.tiers if not t.contains(record.key)]
            if not missing:
                continue
            kv = self.io.read_block(blocks[j])
            for tier in missing:
                tier.store(record, kv)

    def continue_match(
        self,
        keys: list[bytes],
        namespace: str,
        tokens: Sequence[int],
        start: int,
        fresh_block: Callable[[], int | None],
        landed: Callable[[int], None],
    ) -> LoadedBlocks:
        """Continue a memory match of `tokens` that holds their first `start` full blocks with the next full
        blocks that a tier holds intact, in order. For each one `fresh_block()` gives the memory block to
        load it into (None: the pool is short, and the match stops there); once the block holds the
        verified KV, `landed(block)` is called, before the next `fresh_block()`. Stops at the first block
        that no tier holds intact, or whose lookup or load fails: the block given for it then holds
        nothing and is not in the result (the caller frees it)."""
        loaded = LoadedBlocks()
        end = len(tokens) // self.block_size
        if start >= end:
            return loaded
        if not self._or_miss("reading ahead", self._read_ahead, keys, namespace, tokens, start, end):
            return loaded
        try:
            for j in range(start, end):
                if not self._or_miss("looking up a KV block", self._holds, keys, namespace, tokens, j):
                    break
                block = fresh_block()
                if block is None:
                    break
                record = self.record(keys, namespace, tokens, j)
                tier = self._or_miss("loading a KV block", self._load_into, record, block)
                if tier is None:
                    break
                landed(block)
                loaded.blocks.append(block)
                loaded.tiers.append(tier)
        finally:
            self._end_read_ahead()
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
        return any(t.contains(keys[j]) for t in self.tiers)

    def _load_into(self, record: BlockRecord, block: int) -> str | None:
        """Write the block's verified KV into memory `block`; the name of the tier it came from, or None."""
        found = self.fetch(record)
        if found is None:
            return None
        self.io.write_block(block, found[1])
        return found[0]

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

    def flush(self) -> None:
        for tier in self.tiers:
            tier.flush()

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
