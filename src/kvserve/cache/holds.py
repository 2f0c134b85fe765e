"""Holds: the references that outlive requests, pins and retentions, and their rules against the tree.

A pin (pins.py) holds a prefix's full blocks, and with a sliding pool its last window's sliding blocks,
until a time or an unpin; a retention (retention.py) holds a breakpoint's cached prefix until its TTL,
within budgets, and gives way when an allocation could not succeed otherwise. Both own their pool
references as the tree's nodes do; `check` verifies them against the tree.

Pinning off is `NoPins` (every pin refused) and retention off a table with no budget: neither is a
branch here.
"""

import operator
from collections import Counter
from collections.abc import Callable, Sequence

from kvserve.cache.accounting import BlockAccounts
from kvserve.cache.pins import NoPins, Pin, Pins
from kvserve.cache.retention import Retentions, retention_ttl
from kvserve.cache.sequence_blocks import SequenceBlocks

# Lock the cached blocks of a prefix for a sequence, in memory or read from a lower tier at once.
LockCached = Callable[[SequenceBlocks, tuple[int, ...]], None]


class Holds:
    """Invariants (`check`, with BlockAccounts' reference counts):
    - A pin owns one reference to each of its blocks, so a pinned block is never evictable; the distinct
      pinned blocks stay within the PinTable's caps, in all and per namespace.
    - A retention owns one reference to each of its blocks, which are the tree's blocks of its prefix
      in its namespace, within the RetentionTable's caps. Retention never makes an allocation fail.
    """

    def __init__(self, accounts: BlockAccounts, pins: Pins, retentions: Retentions) -> None:
        self.accounts = accounts
        self.pins = pins
        self.retentions = retentions

    def pin(
        self, namespace: str, tokens: Sequence[int], expires_at: float, lock_cached: LockCached
    ) -> Pin | None:
        """See KVCacheManager.pin."""
        prefix = self.pins.pinnable_prefix(tokens)
        extended = self.pins.extend(namespace, prefix, expires_at)
        if extended is not None:
            return extended
        seq = SequenceBlocks(namespace)
        try:
            lock_cached(seq, prefix)
            if len(seq.blocks) < len(prefix) // self.accounts.block_size:
                return None
            return self.pins.add(namespace, prefix, seq.blocks, expires_at, seq.sliding)
        finally:
            # A made pin holds references of its own; however the pin ends (made, not cached, refused,
            # or anything raising), the lock that found its blocks goes: a leak would shrink the pool.
            self.accounts.release_all(seq)

    def retain(
        self,
        namespace: str,
        tokens: Sequence[int],
        breakpoints: Sequence[tuple[int, float]],
        clock: Callable[[], float],
    ) -> list[int]:
        """See KVCacheManager.retain (`clock`: the manager's)."""
        out = []
        for breakpoint in breakpoints:
            try:
                length, ttl_s = breakpoint
                length = operator.index(length)
            except (TypeError, ValueError):
                out.append(0)
                continue
            ttl = retention_ttl(ttl_s)
            if ttl is None or not 0 < length <= len(tokens):
                out.append(0)
                continue
            prefix = self.retentions.retainable(tokens[:length])
            if not prefix:
                out.append(0)
                continue
            blocks = self.accounts.tree.match(namespace, prefix, record_hit=False).blocks
            # Nothing allocates between the match and the retention's references: no block of it can go.
            if blocks:
                held = prefix[: len(blocks) * self.accounts.block_size]
                self.retentions.retain(namespace, held, list(blocks), clock() + ttl)
            out.append(length)
        # A later breakpoint's retention may trim an earlier one's (the budget or the server cap).
        return [self.retentions.held(namespace, tokens[:n]) if n else 0 for n in out]

    def references(self) -> Counter[int]:
        """How many pool references pins and retentions hold on each block."""
        return self.pins.references() + self.retentions.references()

    def pinned_sliding(self) -> list[int]:
        return [b for pin in self.pins.all() for b in pin.sliding]

    def check(self, entries: Sequence[tuple[str, tuple[int, ...], int]]) -> None:
        """Assert the caps, and that pinned and retained blocks are the tree's (`entries`: namespace,
        path, block of each node)."""
        tree_blocks = {b for _, _, b in entries}
        pool = self.accounts.pool
        self.pins.check()
        if any(pool.ref_count(b) < 2 for b in self.pins.blocks() & tree_blocks):
            raise AssertionError("a pinned block is evictable")
        self.retentions.check()
        nodes = {(ns, path): b for ns, path, b in entries}
        bs = self.accounts.block_size
        for r in self.retentions.all():
            if any(nodes.get((r.namespace, r.tokens[: (j + 1) * bs])) != b for j, b in enumerate(r.blocks)):
                raise AssertionError("a retained block is not the tree's block of its prefix")


def pins_for(accounts: BlockAccounts, max_blocks: int, max_blocks_per_namespace: int | None) -> Pins:
    """The pin table: `NoPins` without a pinnable block or without the prefix cache to find prefixes."""
    kind = Pins if accounts.tree.enabled and max_blocks > 0 else NoPins
    return kind(accounts.pool, max_blocks, max_blocks_per_namespace, accounts.block_size, accounts.sliding)
