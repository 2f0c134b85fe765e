"""LowerTiers: the memory tier's view of the tiers below it (disk, then Redis), in order.

It keys blocks (chained, see block_key.py), offers newly computed blocks to every tier, and finds a
block in the first tier that holds it intact. Which tier answered is reported only as a name, for the
per-tier hit counters.
"""

from collections.abc import Sequence

import torch

from kvserve.cache.block_key import ROOT, chain_key
from kvserve.cache.tiers import BlockIO, BlockRecord, LowerTier, Prefetching, TierUsage


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

    def offer(self, record: BlockRecord, block: int) -> None:
        """A block was just computed: every tier that lacks it gets a copy (written behind)."""
        missing = [t for t in self.tiers if not t.contains(record.key)]
        if not missing:
            return
        kv = self.io.read_block(block)
        for tier in missing:
            tier.store(record, kv)

    def begin_admission(
        self, keys: list[bytes], namespace: str, tokens: Sequence[int], start: int, end: int
    ) -> None:
        """An admission will look for blocks `start..end` of `tokens`: tiers that read them in batches
        get the whole run (its keys are computed now only for them)."""
        if not self._prefetching:
            return
        self.extend_keys(keys, namespace, tokens, end)
        run = [self.record(keys, namespace, tokens, j) for j in range(start, end)]
        for tier in self._prefetching:
            tier.prefetch(run, self.io.block_shape(), self.io.dtype)

    def end_admission(self) -> None:
        for tier in self._prefetching:
            tier.prefetch([], self.io.block_shape(), self.io.dtype)

    def holds(self, key: bytes) -> bool:
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

    def flush(self) -> None:
        for tier in self.tiers:
            tier.flush()

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
