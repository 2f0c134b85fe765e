"""StatePool: a hybrid model's recurrent-state slots, beside the KV blocks (or NoStatePool: no recurrent
layers).

A slot holds one sequence's state over every recurrent layer (kvserve.model.recurrent.RecurrentState
holds the tensors; this module only hands out ids and logs the copies). Slot 0 is the model's scratch
and never handed out. Every other slot is, at any time, exactly one of:
- free;
- a running sequence's live state (`SequenceBlocks.state_slot`: its state after `num_computed` tokens);
- a checkpoint: the state after the first P tokens of a prefix, in the prefix tree (at the node holding
  token P - 1), or pending on its sequence until that token's block joins the tree;
- a draft's snapshot: a decoding sequence's state before its draft rows, kept for the step that
  verifies them (a rejection restores it, see the scheduler's `after_step`); it takes a checkpoint slot.

The slots are `live_slots` (one per running sequence) plus `checkpoint_slots`: checkpoints and
snapshots never take more than those, so a live slot is always free when a sequence is admitted. A
sequence's state memory is thus its one live slot, plus the checkpoints the cache chose to keep.

Copies are decided between steps and run by the runner before the next forward pass, in the order they
were decided (`take_copies`). That order alone makes a slot safe to reuse at once: a copy out of a slot
that is freed and handed out again in the same pause runs before anything written into it.
"""

from kvserve.model.recurrent import ZERO


class NoStatePool:
    """A model with no recurrent layers: no slots, no copies."""

    enabled = False
    num_slots = 0
    checkpoint_slots = 0

    def take_copies(self) -> list[tuple[int, int]]:
        return []

    def free_checkpoint(self, slot: int) -> None:
        raise AssertionError("no state pool holds checkpoints")


class StatePool(NoStatePool):
    enabled = True

    def __init__(self, live_slots: int, checkpoint_slots: int) -> None:
        if live_slots < 1 or checkpoint_slots < 0:
            raise ValueError("a state pool needs a live slot per sequence and no negative checkpoint count")
        self.live_slots = live_slots
        self.checkpoint_slots = checkpoint_slots
        self.num_slots = 1 + live_slots + checkpoint_slots
        # Descending, so that pop() hands the lowest id out first.
        self._free = list(range(self.num_slots - 1, 0, -1))
        self.num_checkpoints = 0
        self._copies: list[tuple[int, int]] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    def live(self, source: int | None) -> int:
        """A slot for a sequence, holding the checkpoint `source`'s state (None: zeros)."""
        slot = self._free.pop()
        self.copy(ZERO if source is None else source, slot)
        return slot

    def checkpoint(self) -> int | None:
        """A slot for a checkpoint, None when the checkpoints hold all theirs (evict one, then ask again)."""
        if self.num_checkpoints >= self.checkpoint_slots:
            return None
        self.num_checkpoints += 1
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def free_checkpoint(self, slot: int) -> None:
        self.num_checkpoints -= 1
        self._free.append(slot)

    def copy(self, src: int, dst: int) -> None:
        """Copy slot `src` onto `dst` before the next forward pass (src ZERO: zero it)."""
        self._copies.append((src, dst))

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    def check(self, live: list[int], checkpoints: list[int]) -> None:
        """Every slot but the scratch is free, live (a sequence's state or snapshot) or a checkpoint, and
        only one of them; the checkpoints within their share."""
        held = live + checkpoints + self._free
        assert len(held) == len(set(held)) == self.num_slots - 1, "a state slot is lost or held twice"
        assert 0 not in held, "the scratch slot was handed out"
        assert len(checkpoints) == self.num_checkpoints <= self.checkpoint_slots
