"""NoPrefixCache: the prefix cache switched off, as an object that holds nothing.

It answers the PrefixCache's calls as an empty tree would and keeps nothing inserted, so the
KVCacheManager runs one code path with the cache on or off: every match is empty, nothing is ever
evictable, and a sequence's blocks go back to the pool when it ends.
"""

from collections.abc import Sequence

from kvserve.cache.prefix_cache import Branch, MatchResult


class NoPrefixCache:
    enabled = False
    num_nodes = 0
    num_evicted = 0
    num_tombstoned = 0
    num_checkpoints = 0

    def match(
        self,
        namespace: str,
        tokens: Sequence[int],
        record_hit: bool = True,
        partial: bool = True,
        checkpointed: bool = False,
    ) -> MatchResult:
        return MatchResult()

    def add_checkpoint(self, namespace: str, tokens: Sequence[int], slot: int) -> bool:
        return False

    def evict_checkpoint(self) -> bool:
        return False

    def insert(
        self,
        namespace: str,
        tokens: Sequence[int],
        blocks: Sequence[int],
        sliding: Sequence[int] | None = None,
    ) -> int:
        """Keeps nothing: the blocks stay their sequence's, freed when it lets go of them."""
        return 0

    def evict(self, num_blocks: int) -> int:
        return 0

    def evict_sliding(self, num_blocks: int) -> int:
        return 0

    def reset(self) -> int:
        return 0

    def num_nodes_in(self, namespace: str) -> int:
        return 0

    def hot_branches(self, limit: int, namespace: str | None = None) -> list[Branch]:
        return []

    def entries(self) -> list[tuple[str, tuple[int, ...], int]]:
        return []

    def sliding_entries(self) -> dict[tuple[str, tuple[int, ...]], int | None]:
        return {}
