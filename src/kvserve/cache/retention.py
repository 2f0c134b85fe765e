"""Retention: cached prefixes a client marked (a prompt-cache breakpoint) held against eviction for a
while, within budgets that trim old retentions rather than refuse new ones.

Pins (pins.py) are explicit and hard: a pin over a cap is refused, and a pinned block is never given up
before its time. A retention is a side effect of an ordinary request, so it is never refused: what does
not fit its budget trims older retentions instead. A `RetentionTable` records retentions and
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
- Budget: past `max_blocks_per_namespace` distinct blocks, the namespace's own retentions are trimmed
  until it fits. No other namespace's retention is touched.
- Server cap: past `max_blocks` distinct blocks in all, retentions of any namespace are trimmed until
  the total fits.
- Memory: when an allocation finds no block free or evictable and no other sequence could free one,
  the manager asks the table to `give_way` a block at a time, trimmed the same way.
- Expiry: a retention ends at `expires_at` on the manager's clock, and its blocks stay cached, evictable.

Trimming gives up exactly the blocks that are over, one at a time, each from the end of a retention:
it keeps its first blocks (the most shared part), and the block it lets go is its deepest, the one
eviction takes first. Each cut is from the oldest retention (least recently made or refreshed, by a
counter that never repeats: two never tie, and a name never decides) whose last block no other
retention of its namespace holds (cutting any other would free nothing). A retention cut to nothing,
or to a prefix another retention of its namespace holds as long, is removed. So a retention goes whole
only when every one of its blocks was needed, never to make room for less.

A new retention may trim other namespaces' retentions, oldest first, since retention is never refused
and the newest breakpoint is the likeliest to be read again; but never more of them than it adds: the
total was within the cap before it, so a retain that adds n blocks is at most n over. A namespace's
retains never shrink it, so over any sequence of them it takes from the others at most what it grew
by, at most its budget (past it, it trims its own). The retention being made is the newest, so it
would be cut only if nothing older could give a block, which never happens with the tree's blocks: a
block that no older retention could give up lies in its own prefix.

Invariants (`check`, and `KVCacheManager.check` for the references): a namespace's retentions hold at
most `max_blocks_per_namespace` distinct blocks, all of them at most `max_blocks`; no block is retained
by two namespaces (each has its own tree); every retention holds one block per `block_size` tokens, at
least one; no two retentions of a namespace hold one prefix, and none's prefix is extended by another
retention of its namespace that outlasts it; no two retentions share an age; and the blocks and
retentions given up (`dropped_blocks`, `dropped`) are counted by reason.
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


def _covers(other: Retention, retention: Retention) -> bool:
    """Whether `other` holds all of `retention`'s prefix for at least as long (it then adds nothing)."""
    held = other.tokens[: len(retention.tokens)] == retention.tokens
    return held and other.expires_at >= retention.expires_at


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
        # Retentions removed whole, and blocks given up, before their time, by reason.
        self.dropped: Counter[str] = Counter()
        self.dropped_blocks: Counter[str] = Counter()

    @property
    def enabled(self) -> bool:
        return self.max_blocks_per_namespace > 0

    def retainable(self, tokens: Sequence[int]) -> tuple[int, ...]:
        """The part of `tokens` a retention would hold: its full blocks, at most a namespace's budget of
        them (empty: nothing to hold)."""
        return tuple(tokens[: self.retainable_length(len(tokens))])

    def retainable_length(self, num_tokens: int) -> int:
        """How many of a prefix's `num_tokens` tokens a retention would hold (see `retainable`)."""
        return min(num_tokens // self.block_size, self.max_blocks_per_namespace) * self.block_size

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
        self._trim(self.num_blocks_in(namespace) - self.max_blocks_per_namespace, DROPPED_BUDGET, namespace)
        self._trim(self.num_blocks - self.max_blocks, DROPPED_SERVER_CAP, None)
        return new

    def held(self, namespace: str, tokens: Sequence[int]) -> int:
        """How many of `tokens`' first tokens the namespace's retentions hold (whole blocks)."""
        bs = self.block_size
        best = 0
        for r in self._of.get(namespace, ()):
            # Equal first blocks are a prefix property: the longest is found by bisection.
            lo, hi = 0, min(len(r.blocks), len(tokens) // bs)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if r.tokens[: mid * bs] == tuple(tokens[: mid * bs]):
                    lo = mid
                else:
                    hi = mid - 1
            best = max(best, lo * bs)
        return best

    def _supersede(self, retention: Retention) -> None:
        """Remove the shorter retentions of its namespace that `retention` extends and outlasts."""
        for held in self.of(retention.namespace):
            if _extends(retention.tokens, held.tokens) and held.expires_at <= retention.expires_at:
                self._remove(held)

    def give_way(self) -> bool:
        """Give up one retained block for memory (see trimming); False when none is held."""
        if not self._of:
            return False
        self._cut(self._victim(None), DROPPED_MEMORY)
        return True

    def expired(self, now: float) -> list[Retention]:
        return [r for rs in self._of.values() for r in rs if r.expires_at <= now]

    def expire(self, now: float) -> int:
        """Remove every retention whose time is over at `now`; returns how many."""
        expired = self.expired(now)
        for retention in expired:
            self._remove(retention)
        return len(expired)

    def _trim(self, count: int, reason: str, namespace: str | None) -> None:
        """Give up `count` blocks (none when it is not positive) of `namespace`'s retentions, or of any
        namespace's with None, one cut at a time (see trimming in the module docstring)."""
        for _ in range(count):
            self._cut(self._victim(namespace), reason)

    def _victim(self, namespace: str | None) -> Retention:
        """The oldest retention whose last block no other retention of its namespace holds."""
        pool = self._of[namespace] if namespace is not None else self.all()
        return min((r for r in pool if self._refs[r.namespace][r.blocks[-1]] == 1), key=lambda r: r.used)

    def _cut(self, retention: Retention, reason: str) -> None:
        """Give up `retention`'s last block (which it alone holds), keeping its first blocks; remove it
        when nothing is left, or when what is left another retention of its namespace holds as long."""
        block = retention.blocks.pop()
        retention.tokens = retention.tokens[: len(retention.blocks) * self.block_size]
        del self._refs[retention.namespace][block]
        self._let_go([block])
        self.dropped_blocks[reason] += 1
        if not retention.blocks:
            self._remove(retention)
            self.dropped[reason] += 1
        elif any(_covers(o, retention) for o in self._of[retention.namespace] if o is not retention):
            self._remove(retention)

    def _add(self, retention: Retention) -> None:
        self._hold(retention.blocks)
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
        self._let_go(retention.blocks)

    def _hold(self, blocks: list[int]) -> None:
        """Blocks were retained (Retentions takes their references here)."""

    def _let_go(self, blocks: list[int]) -> None:
        """Blocks are no longer retained (Retentions gives their references back here)."""

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
                if any(_covers(o, r) or o.tokens == r.tokens for o in retentions if o is not r):
                    raise AssertionError("a retention's prefix is held by another, as long or longer")
        if len(seen) > self.max_blocks:
            raise AssertionError("more blocks are retained than the server's cap")
        ages = [r.used for r in self.all()]
        if len(set(ages)) != len(ages):
            raise AssertionError("two retentions share an age")
        if any(self.dropped[reason] > self.dropped_blocks[reason] for reason in self.dropped):
            raise AssertionError("a retention was dropped without giving up a block")


class Retentions(RetentionTable):
    """A RetentionTable whose retentions own one pool reference to each of their blocks."""

    def __init__(
        self, pool: BlockPool, max_blocks: int, max_blocks_per_namespace: int, block_size: int
    ) -> None:
        super().__init__(max_blocks, max_blocks_per_namespace, block_size)
        self.pool = pool

    def _hold(self, blocks: list[int]) -> None:
        for b in blocks:
            self.pool.ref(b)

    def _let_go(self, blocks: list[int]) -> None:
        for b in blocks:
            self.pool.release(b)
