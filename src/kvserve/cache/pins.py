"""Pins: prefixes held in memory until a time, and the caps on how many blocks may be pinned.

A `PinTable` records pins and enforces their caps; it never touches a reference count. `Pins` is the
table the KVCacheManager keeps: its pins also own their pool references, as the PrefixCache owns the
tree's. The manager locks a cached prefix's blocks and hands them to `add`, which takes the pin's own
reference to each; `remove` and `expire` give them back. Together they keep these invariants
(`KVCacheManager.check` verifies them):
- Every pin in `Pins` owns one pool reference to each of its `blocks`, and with a sliding pool one to
  each of its `sliding` blocks (those of its prefix's last window, what keeps the prefix usable), so a
  pinned block is never evictable nor a pinned window tombstoned;
  a pin leaves it only through `remove` (unpinned) or `expire` (its time is over), and its
  references go with it.
- The distinct blocks of all pins never exceed `max_blocks`, nor those of one namespace (a tenant or a
  shared group) `max_blocks_per_namespace`: `add` refuses a pin that would exceed either before it
  records or references anything.
- A namespace pins a prefix at most once: pinning it again extends the pin that holds it (`extend`).
"""

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvserve.cache.block_pool import RELEASED, BlockPool
from kvserve.cache.sliding_pool import NO_SLIDING_POOL, NoSlidingPool


class PinRefused(ValueError):
    """A pin that the cache cannot take (pinning off, over the cap, shorter than a block)."""


@dataclass(eq=False)
class Pin:
    """A prefix held in memory until `expires_at` (the manager's clock): it owns one pool reference to
    each of `blocks`, the full blocks of `tokens`, and one sliding-pool reference to each of `sliding`,
    the sliding blocks of its last window (none without a sliding pool). `max_blocks` counts `blocks`:
    the sliding ones are ceil(window / block_size) + 1 at most."""

    pin_id: str
    namespace: str
    tokens: tuple[int, ...]
    blocks: list[int]
    expires_at: float
    sliding: list[int] = field(default_factory=list)


class PinTable:
    def __init__(self, max_blocks: int, max_blocks_per_namespace: int | None, block_size: int) -> None:
        self.max_blocks = max_blocks
        # Namespaces are tenants (or shared groups): one tenant's pins cannot take every pinnable block.
        self.max_blocks_per_namespace = (
            max_blocks if max_blocks_per_namespace is None else max_blocks_per_namespace
        )
        self.block_size = block_size
        self._pins: dict[str, Pin] = {}
        self._ids = itertools.count(1)

    def pinnable_prefix(self, tokens: Sequence[int]) -> tuple[int, ...]:
        """The full blocks of `tokens`, the part a pin holds; PinRefused when it is empty or over the cap
        on its own."""
        bs = self.block_size
        n = len(tokens) // bs
        if n == 0:
            raise PinRefused(f"the prefix is shorter than one KV block ({bs} tokens): nothing to pin")
        if n > self.max_blocks:
            raise PinRefused(
                f"the prefix needs {n * bs} pinned tokens, over the cap of {self.max_blocks * bs}"
            )
        return tuple(tokens[: n * bs])

    def extend(self, namespace: str, prefix: tuple[int, ...], expires_at: float) -> Pin | None:
        """The namespace's pin of `prefix`, now held at least until `expires_at`; None if it has none."""
        for pin in self._pins.values():
            if pin.namespace == namespace and pin.tokens == prefix:
                pin.expires_at = max(pin.expires_at, expires_at)
                return pin
        return None

    def add(self, namespace: str, prefix: tuple[int, ...], blocks: list[int], expires_at: float) -> Pin:
        """Record a pin of `prefix` that owns a reference to each of `blocks` (taken by the caller).
        Raises PinRefused, recording nothing, when it would exceed a cap."""
        bs = self.block_size
        added = len(prefix)
        total = len(self.blocks() | set(blocks))
        if total > self.max_blocks:
            raise PinRefused(
                f"pinning {added} more tokens would hold {total * bs} pinned tokens, over the cap of "
                f"{self.max_blocks * bs}; unpin something first"
            )
        mine = len(self.blocks_in(namespace) | set(blocks))
        if mine > self.max_blocks_per_namespace:
            raise PinRefused(
                f"pinning {added} more tokens would hold {mine * bs} pinned tokens in this namespace, "
                f"over its cap of {self.max_blocks_per_namespace * bs}; unpin something first"
            )
        pin = Pin(f"pin-{next(self._ids)}", namespace, prefix, blocks, expires_at)
        self._pins[pin.pin_id] = pin
        return pin

    def remove(self, namespace: str, pin_id: str) -> Pin | None:
        """Take the namespace's pin out of the table (its references are the caller's to release); None
        if it has none by that id."""
        pin = self._pins.get(pin_id)
        if pin is None or pin.namespace != namespace:
            return None
        del self._pins[pin_id]
        return pin

    def expired(self, now: float) -> list[Pin]:
        return [p for p in self._pins.values() if p.expires_at <= now]

    def of(self, namespace: str) -> list[Pin]:
        return [p for p in self._pins.values() if p.namespace == namespace]

    def all(self) -> list[Pin]:
        return list(self._pins.values())

    def blocks(self) -> set[int]:
        return {b for p in self._pins.values() for b in p.blocks}

    def blocks_in(self, namespace: str) -> set[int]:
        return {b for p in self._pins.values() if p.namespace == namespace for b in p.blocks}

    def references(self) -> Counter[int]:
        """How many pool references the pins hold on each block."""
        return Counter(b for p in self._pins.values() for b in p.blocks)

    def check(self) -> None:
        """Assert the caps (the references are checked by the manager, which owns them)."""
        if len(self.blocks()) > self.max_blocks:
            raise AssertionError("more blocks are pinned than the cap allows")
        for namespace in {p.namespace for p in self._pins.values()}:
            if len(self.blocks_in(namespace)) > self.max_blocks_per_namespace:
                raise AssertionError(f"namespace {namespace!r} pins more blocks than its cap")


class Pins(PinTable):
    """A PinTable whose pins own one pool reference to each of their blocks."""

    def __init__(
        self,
        pool: BlockPool,
        max_blocks: int,
        max_blocks_per_namespace: int | None,
        block_size: int,
        sliding: NoSlidingPool = NO_SLIDING_POOL,
    ) -> None:
        super().__init__(max_blocks, max_blocks_per_namespace, block_size)
        self.pool = pool
        self.sliding = sliding

    def add(
        self,
        namespace: str,
        prefix: tuple[int, ...],
        blocks: list[int],
        expires_at: float,
        sliding: Sequence[int] = (),
    ) -> Pin:
        """Record a pin of `prefix` held in `blocks` and the sliding blocks `sliding` (RELEASED entries
        skipped; all locked by the caller, who keeps its own references) and take the pin's reference
        to each; PinRefused, taking nothing, over a cap."""
        pin = super().add(namespace, prefix, list(blocks), expires_at)
        for b in pin.blocks:
            self.pool.ref(b)
        pin.sliding = [b for b in sliding if b != RELEASED]
        self.sliding.ref_all(pin.sliding)
        return pin

    def remove(self, namespace: str, pin_id: str) -> Pin | None:
        """Drop the namespace's pin and its references (its blocks stay cached, evictable); None if it
        has none by that id."""
        pin = super().remove(namespace, pin_id)
        if pin is not None:
            for b in pin.blocks:
                self.pool.release(b)
            self.sliding.release_all(pin.sliding)
        return pin

    def expire(self, now: float) -> int:
        """Remove every pin whose time is over at `now`; returns how many."""
        expired = self.expired(now)
        for pin in expired:
            self.remove(pin.namespace, pin.pin_id)
        return len(expired)


class NoPins(Pins):
    """Pinning off (no pinnable blocks, or no prefix cache to find a prefix in): every pin is refused,
    so the table stays empty; its caps are still reported as configured."""

    def pinnable_prefix(self, tokens: Sequence[int]) -> tuple[int, ...]:
        raise PinRefused("pinning is off: start the server with --max-pinned-tokens")
