"""Retention: cached prefixes a client marked (a prompt-cache breakpoint) held against eviction for a
while, within budgets that drop old retentions rather than refuse new ones.

Pins (pins.py) are explicit and hard: a pin over a cap is refused, and a pinned block is never given up
before its time. A retention is a side effect of an ordinary request, so it is never refused: what does
not fit its budget pushes out an older retention instead. A `RetentionTable` records retentions and
keeps their budgets; it never touches a reference count. `Retentions` is the table the KVCacheManager
keeps, whose retentions own one pool reference to each of their blocks, as pins do.

The rules, in the order `retain` applies them:
- A retention holds the full blocks of a prefix (a breakpoint's tokens rounded down to a block), at most
  `max_blocks_per_namespace` of them: a longer prefix keeps its first blocks, the most shared part.
- One retention per namespace and prefix: retaining a prefix again refreshes it (its time is the later
  of the two, and it becomes the namespace's newest).
- A retention whose prefix another retention of its namespace extends, and which that one outlasts, adds
  nothing: retaining it refreshes the longer one instead, and a new retention supersedes (removes) the
  shorter retentions it outlasts. An agent whose breakpoint moves to the end of its context every turn
  therefore holds one retention, while a system prompt retained for an hour under a conversation
  retained for five minutes stays a retention of its own.
- Budget: past `max_blocks_per_namespace` distinct blocks, the namespace's own oldest retentions (least
  recently made or refreshed) are dropped until it fits. No other namespace's retention is touched.
- Server cap: past `max_blocks` distinct blocks in all, the namespace holding the most retained blocks
  gives up its oldest retention, until the total fits (the new retention is never the one dropped).
- Memory: when an allocation finds no block free or evictable and no other sequence could free one,
  the manager asks the table to `give_way`: the namespace holding the most gives up its oldest.
- Expiry: a retention ends at `expires_at` on the manager's clock, and its blocks stay cached, evictable.

Invariants (`check`, and `KVCacheManager.check` for the references): a namespace's retentions hold at
most `max_blocks_per_namespace` distinct blocks, all of them at most `max_blocks`; no block is retained
by two namespaces (each has its own tree); every retention holds one block per `block_size` tokens; and
no retention's prefix is extended by another retention of its namespace that outlasts it.
"""

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.cache.block_pool import BlockPool

# Anthropic's longest cache TTL; a longer one is held for this long.
MAX_RETENTION_TTL_S = 3600.0

# Why retentions were dropped before their time, as counted in `dropped`.
DROPPED_BUDGET = "budget"
DROPPED_SERVER_CAP = "server_cap"
DROPPED_MEMORY = "memory"


@dataclass(eq=False)
class Retention:
    """A prefix held against eviction until `expires_at` (the manager's clock): `blocks` are the full
    blocks of `tokens`. `used` orders retentions by when they were last made or refreshed (the lowest
    is the oldest)."""

    namespace: str
    tokens: tuple[int, ...]
    blocks: list[int]
    expires_at: float
    used: int


def retention_ttl(ttl_s: object) -> float | None:
    """A breakpoint's TTL in seconds as retention takes it (at most MAX_RETENTION_TTL_S), or None for a
    value that holds nothing (not a positive finite number)."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float):
        return None
    if not math.isfinite(ttl_s) or ttl_s <= 0:
        return None
    return min(float(ttl_s), MAX_RETENTION_TTL_S)


def _extends(longer: tuple[int, ...], shorter: tuple[int, ...]) -> bool:
    return len(longer) > len(shorter) and longer[: len(shorter)] == shorter


class RetentionTable:
    def __init__(self, max_blocks: int, max_blocks_per_namespace: int, block_size: int) -> None:
        if max_blocks < 0 or max_blocks_per_namespace < 0:
            raise ValueError("retention budgets must be >= 0")
        self.max_blocks = max_blocks
        self.max_blocks_per_namespace = min(max_blocks_per_namespace, max_blocks)
        self.block_size = block_size
        self._of: dict[str, list[Retention]] = {}
        # Per namespace: how many of its retentions hold each block (its distinct blocks are the keys).
        self._refs: dict[str, Counter[int]] = {}
        self._used = itertools.count(1)
        self.dropped: Counter[str] = Counter()

    @property
    def enabled(self) -> bool:
        return self.max_blocks_per_namespace > 0

    def retainable(self, tokens: Sequence[int]) -> tuple[int, ...]:
        """The part of `tokens` a retention would hold: its full blocks, at most a namespace's budget of
        them (empty: nothing to hold)."""
        n = min(len(tokens) // self.block_size, self.max_blocks_per_namespace)
        return tuple(tokens[: n * self.block_size])

    def retain(
        self, namespace: str, prefix: tuple[int, ...], blocks: list[int], expires_at: float
    ) -> Retention:
        """Hold `prefix` (from `retainable`, cut to what is cached) in `blocks`, its full blocks, until
        `expires_at` at least; returns the retention that now holds it, after the rules of the module
        docstring (refresh, supersede, budget, server cap)."""
        if len(blocks) * self.block_size != len(prefix) or not blocks:
            raise ValueError("a retention holds one block per block_size tokens, at least one")
        if len(blocks) > self.max_blocks_per_namespace:
            raise ValueError("a retention longer than its namespace's budget (see retainable)")
        mine = self._of.get(namespace, [])
        held = next((r for r in mine if r.tokens == prefix), None) or next(
            (r for r in mine if _extends(r.tokens, prefix) and r.expires_at >= expires_at), None
        )
        if held is not None:
            held.expires_at = max(held.expires_at, expires_at)
            held.used = next(self._used)
            self._supersede(held)
            return held
        new = Retention(namespace, prefix, list(blocks), expires_at, next(self._used))
        self._add(new)
        self._supersede(new)
        while self.num_blocks_in(namespace) > self.max_blocks_per_namespace:
            self._drop(self._oldest(namespace, new), DROPPED_BUDGET)
        while self.num_blocks > self.max_blocks:
            self._drop(self._largest_oldest(new), DROPPED_SERVER_CAP)
        return new

    def _supersede(self, retention: Retention) -> None:
        """Remove the shorter retentions of its namespace that `retention` extends and outlasts."""
        for held in self.of(retention.namespace):
            if _extends(retention.tokens, held.tokens) and held.expires_at <= retention.expires_at:
                self._remove(held)

    def give_way(self) -> bool:
        """Drop one retention for memory (the largest namespace's oldest); False when none is held."""
        if not self._of:
            return False
        self._drop(self._largest_oldest(None), DROPPED_MEMORY)
        return True

    def expired(self, now: float) -> list[Retention]:
        return [r for rs in self._of.values() for r in rs if r.expires_at <= now]

    def expire(self, now: float) -> int:
        """Remove every retention whose time is over at `now`; returns how many."""
        expired = self.expired(now)
        for retention in expired:
            self._remove(retention)
        return len(expired)

    def _oldest(self, namespace: str, keep: Retention) -> Retention:
        return min((r for r in self._of[namespace] if r is not keep), key=lambda r: r.used)

    def _largest_oldest(self, keep: Retention | None) -> Retention:
        """The oldest retention (other than `keep`) of the namespace holding the most retained blocks."""
        namespaces = sorted(self._of, key=lambda ns: (-len(self._refs[ns]), ns))
        for namespace in namespaces:
            others = [r for r in self._of[namespace] if r is not keep]
            if others:
                return min(others, key=lambda r: r.used)
        raise AssertionError("nothing to drop but the retention being made")

    def _drop(self, retention: Retention, reason: str) -> None:
        self._remove(retention)
        self.dropped[reason] += 1

    def _add(self, retention: Retention) -> None:
        self._hold(retention)
        self._of.setdefault(retention.namespace, []).append(retention)
        self._refs.setdefault(retention.namespace, Counter()).update(retention.blocks)

    def _remove(self, retention: Retention) -> None:
        namespace = retention.namespace
        self._of[namespace].remove(retention)
        refs = self._refs[namespace]
        refs.subtract(retention.blocks)
        for b in retention.blocks:
            if refs[b] == 0:
                del refs[b]
        if not self._of[namespace]:
            del self._of[namespace], self._refs[namespace]
        self._let_go(retention)

    def _hold(self, retention: Retention) -> None:
        """A retention was recorded (Retentions takes its references here)."""

    def _let_go(self, retention: Retention) -> None:
        """A retention was removed (Retentions gives its references back here)."""

    def of(self, namespace: str) -> list[Retention]:
        return list(self._of.get(namespace, ()))

    def all(self) -> list[Retention]:
        return [r for rs in self._of.values() for r in rs]

    @property
    def num_blocks(self) -> int:
        """Distinct retained blocks (namespaces never share a block)."""
        return sum(len(refs) for refs in self._refs.values())

    def num_blocks_in(self, namespace: str) -> int:
        refs = self._refs.get(namespace)
        return len(refs) if refs is not None else 0

    def references(self) -> Counter[int]:
        """How many pool references the retentions hold on each block."""
        return Counter(b for rs in self._of.values() for r in rs for b in r.blocks)

    def check(self) -> None:
        """Assert the invariants of the module docstring (the references are checked by the manager)."""
        seen: set[int] = set()
        for namespace, retentions in self._of.items():
            if not retentions:
                raise AssertionError(f"namespace {namespace!r} is listed without retentions")
            blocks = {b for r in retentions for b in r.blocks}
            if Counter(b for r in retentions for b in r.blocks) != self._refs[namespace]:
                raise AssertionError(f"namespace {namespace!r}'s retained block count drifted")
            if len(blocks) > self.max_blocks_per_namespace:
                raise AssertionError(f"namespace {namespace!r} retains more blocks than its budget")
            if blocks & seen:
                raise AssertionError("two namespaces retain one block")
            seen |= blocks
            for r in retentions:
                if r.namespace != namespace or not r.blocks:
                    raise AssertionError("a retention is filed under another namespace, or holds nothing")
                if len(r.blocks) * self.block_size != len(r.tokens):
                    raise AssertionError("a retention's blocks do not match its tokens")
                if any(_extends(o.tokens, r.tokens) and o.expires_at >= r.expires_at for o in retentions):
                    raise AssertionError("a retention is covered by a longer one that outlasts it")
        if len(seen) > self.max_blocks:
            raise AssertionError("more blocks are retained than the server's cap")


class Retentions(RetentionTable):
    """A RetentionTable whose retentions own one pool reference to each of their blocks."""

    def __init__(
        self, pool: BlockPool, max_blocks: int, max_blocks_per_namespace: int, block_size: int
    ) -> None:
        super().__init__(max_blocks, max_blocks_per_namespace, block_size)
        self.pool = pool

    def _hold(self, retention: Retention) -> None:
        for b in retention.blocks:
            self.pool.ref(b)

    def _let_go(self, retention: Retention) -> None:
        for b in retention.blocks:
            self.pool.release(b)
