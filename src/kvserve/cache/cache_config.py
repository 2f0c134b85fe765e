"""CacheConfig: what a KVCacheManager is built from, and which do-nothing objects it gets."""

from dataclasses import dataclass

from kvserve.cache.block_pool import BlockPool
from kvserve.cache.loader import LOAD_BUDGET_S
from kvserve.cache.sliding_pool import NO_SLIDING_POOL, NoSlidingPool, SlidingPool
from kvserve.cache.state_pool import NoStatePool, StatePool


@dataclass(frozen=True)
class CacheConfig:
    """The pool and the features of a KVCacheManager.

    `num_sliding_blocks` and `sliding_window` (both or neither): the sliding layers' own pool and the
    model's largest window. `max_pinned_blocks_per_namespace` None: the server's cap. The retention
    caps, in all and per namespace, are 0 for retention off (always off without the prefix cache).
    `load_budget_s`: how long a request waits at most for blocks read from the lower tiers."""

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    max_pinned_blocks: int = 0
    max_pinned_blocks_per_namespace: int | None = None
    num_sliding_blocks: int = 0
    sliding_window: int | None = None
    max_retained_blocks: int = 0
    max_retained_blocks_per_namespace: int = 0
    load_budget_s: float = LOAD_BUDGET_S
    # A hybrid model's recurrent-state slots (state_pool.py): live ones (0: no recurrent layers) and
    # checkpoints.
    live_state_slots: int = 0
    state_checkpoint_slots: int = 0

    def states(self) -> NoStatePool:
        if not self.live_state_slots:
            return NoStatePool()
        return StatePool(self.live_state_slots, self.state_checkpoint_slots)

    def sliding(self) -> NoSlidingPool:
        if (self.num_sliding_blocks > 0) != (self.sliding_window is not None):
            raise ValueError("a sliding pool needs its window")
        if self.sliding_window is None:
            return NO_SLIDING_POOL
        return SlidingPool(BlockPool(self.num_sliding_blocks), self.sliding_window, self.block_size)
