"""KVCacheManager: the engine's one door to KV memory: match, lock, allocate (evicting if needed), free."""

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.cache.block_pool import BlockPool
from kvserve.cache.prefix_cache import MatchResult, PrefixCache


@dataclass(frozen=True)
class CacheUsage:
    num_blocks: int
    num_free: int
    num_cached: int
    num_locked: int
    num_evicted: int

    @property
    def usage(self) -> float:
        """Fraction of the pool held by running requests (cached but unlocked blocks count as free)."""
        return self.num_locked / self.num_blocks


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.prefix_cache = PrefixCache(self.pool, block_size) if enable_prefix_caching else None

    def match(self, namespace: str, tokens: Sequence[int]) -> MatchResult:
        if self.prefix_cache is None:
            return MatchResult()
        return self.prefix_cache.match(namespace, tokens)

    def lock(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.pool.ref(b)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks, evicting unlocked cached blocks if the free list is short; None if impossible."""
        short = n - self.pool.num_free
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(short)
        if n > self.pool.num_free:
            return None
        return self.pool.allocate(n)

    def cache(self, namespace: str, tokens: Sequence[int], blocks: Sequence[int]) -> None:
        """Make computed KV findable: blocks[j] holds tokens[j*bs:(j+1)*bs]."""
        if self.prefix_cache is not None and tokens:
            self.prefix_cache.insert(namespace, tokens, blocks)

    def free(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.pool.release(b)

    def reset_prefix_cache(self) -> int:
        return self.prefix_cache.reset() if self.prefix_cache is not None else 0

    def usage(self) -> CacheUsage:
        cached = [b for _, _, b in self.prefix_cache.entries()] if self.prefix_cache is not None else []
        unlocked_cached = sum(1 for b in cached if self.pool.ref_count(b) == 1)
        return CacheUsage(
            num_blocks=self.pool.num_blocks,
            num_free=self.pool.num_free,
            num_cached=len(cached),
            num_locked=self.pool.num_used - unlocked_cached,
            num_evicted=self.prefix_cache.num_evicted if self.prefix_cache is not None else 0,
        )
