"""SequenceBlocks: one sequence's hold on KV memory (only the KVCacheManager and the rules it calls
change it)."""

from dataclasses import dataclass, field


@dataclass(eq=False)
class SequenceBlocks:
    """One sequence's hold on KV memory.

    `blocks[j]` holds the sequence's tokens [j * block_size, (j + 1) * block_size), and the sequence owns
    one pool reference to each. The first `num_published` blocks are full and findable in the prefix
    cache. While `copy_source` is set, the sequence also holds a reference to that cached block: its first
    tokens are being copied into `blocks[num_published]` (copy on write) by the step that runs next.
    """

    namespace: str
    blocks: list[int] = field(default_factory=list)
    num_published: int = 0
    copy_source: int | None = None
    # Chain keys of the first full blocks, computed as far as needed (only with lower tiers).
    keys: list[bytes] = field(default_factory=list)
    # With a sliding pool of its own (sliding_pool.py): `sliding[j]` is the sliding layers' block of the
    # positions of `blocks[j]`, RELEASED for the first `num_released` (wholly before the next token's
    # window); empty without one.
    sliding: list[int] = field(default_factory=list)
    num_released: int = 0
    # The tokens computed as of admission or the last `publish` (what the sliding release is measured
    # against).
    num_computed: int = 0
    # The sliding block of `copy_source`, copied alike into `sliding[num_published]`.
    sliding_copy_source: int | None = None
    # A hybrid model's state slots (state_pool.py): the live state, a draft's snapshot, and checkpoints
    # (position, slot) whose last token's block is not in the tree yet.
    state_slot: int | None = None
    snapshot: int | None = None
    pending: list[tuple[int, int]] = field(default_factory=list)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """The blocks that hold `num_tokens` tokens."""
    return -(-num_tokens // block_size)
