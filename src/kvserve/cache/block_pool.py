"""BlockPool: a fixed set of KV blocks with reference counts."""

# A sliding-layer entry without a block: a sequence let it go (wholly before every window it reads), or
# a tree node's sliding part was freed (a tombstone). No pool hands out this id.
RELEASED = -1


class BlockPool:
    """Hands out block ids 0..num_blocks-1.

    Invariant: a block is on the free list exactly when its reference count is 0. Every holder of a
    block (a running request's block table, a node of the prefix cache) owns one reference.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV pool needs at least one block; raise kv_cache_memory")
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        # Popped from the end: the most recently freed block is reused first.
        self._free = list(range(num_blocks - 1, -1, -1))
        # Blocks with two or more references, kept up to date so that usage needs no scan.
        self.num_shared = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with one reference each; raises MemoryError (and takes none) if fewer are free."""
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def ref(self, block: int) -> None:
        if self._refs[block] == 0:
            raise ValueError(f"block {block} is free and cannot gain a reference")
        self._refs[block] += 1
        if self._refs[block] == 2:
            self.num_shared += 1

    def release(self, block: int) -> None:
        if self._refs[block] == 0:
            raise ValueError(f"block {block} is already free")
        self._refs[block] -= 1
        if self._refs[block] == 1:
            self.num_shared -= 1
        elif self._refs[block] == 0:
            self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._refs[block]
