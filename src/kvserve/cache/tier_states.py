"""TierStates: a hybrid model's recurrent-state checkpoints in the lower tiers, beside its KV blocks.

A checkpoint at position P (the state after the first P tokens of a prefix) is a second kind of value in
the same tiers, keyed like a block (block_key.py:state_key): the model fingerprint, the state layout (a
digest of the slot's tensors' shapes and dtypes), the namespace, the key of the last full block before
P (ROOT for none) and the 0 to block_size - 1 tokens after it, so the key binds the exact prefix. Its
value is the slot's tensors' bytes in layer order as one flat uint8 tensor, sealed by the tier as a
block is (block_seal.py), under a header of its own that names the layout, so a value of another
layout, size or kind never opens.

Written when a checkpoint joins the prefix tree (`offer`, on the engine thread: the slot is read after
the logged state copies have run), as blocks are at publish: a `kill -9` loses only what is being
written, and evicting a checkpoint needs no I/O. Read on a loader's thread (`read`): the positions past
memory's last checkpoint up to the end of the KV the admission will hold, newest first and at most
MAX_STATE_PROBES of them, are asked of each tier at once (`LowerTier.find`: the disk tier's index, one
pipelined EXISTS in Redis); the newest found that loads intact wins. The checkpoint positions are not
stored anywhere else: a reply's end, a turn's end or a breakpoint is found wherever it lies.
"""

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvserve.cache.block_key import ROOT, StateKeys
from kvserve.cache.lower_tiers import LowerTiers
from kvserve.cache.tiers import BlockRecord, StateIO

# Positions one admission looks up, newest first: a checkpoint further back than this behind the KV
# match's end is not looked for (keys cost a hash each, and Redis a pipelined EXISTS).
MAX_STATE_PROBES = 4096


@dataclass(frozen=True)
class WantedState:
    """An admission's state lookup: a checkpoint after `after` (memory's last one) and at or before
    `end` (the KV memory holds), of the prompt `tokens`; `end` grows with the blocks a load reads."""

    after: int
    end: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class FoundState:
    """A checkpoint read from a tier, verified: the state after `position` tokens, as packed bytes."""

    position: int
    tier: str
    packed: torch.Tensor


def state_layout(io: StateIO) -> bytes:
    """A digest of the slot's tensors' shapes and dtypes, in order."""
    text = ";".join(
        f"{spec.dtype}:{list(shape)}" for spec in io.specs if spec is not None for shape in spec.shapes
    )
    return hashlib.sha256(text.encode()).digest()


class TierStates:
    def __init__(self, lower: LowerTiers, io: StateIO) -> None:
        self.lower = lower
        self.io = io
        self.layout = state_layout(io)
        self._tensors = [
            (shape, spec.dtype) for spec in io.specs if spec is not None for shape in spec.shapes
        ]
        self.num_bytes = sum(dtype.itemsize * _numel(shape) for shape, dtype in self._tensors)

    def records(
        self, keys: list[bytes], namespace: str, tokens: Sequence[int], positions: Sequence[int]
    ) -> list[BlockRecord]:
        """The records of the checkpoints after `tokens[:p]` for each p of `positions`; `keys` are the
        prefix's chain keys so far (extended as needed)."""
        bs = self.lower.block_size
        state_keys = StateKeys(self.lower.fingerprint, self.layout, namespace)
        self.lower.extend_keys(keys, namespace, tokens, max(positions, default=0) // bs)
        out = []
        for position in positions:
            full = position // bs
            parent = keys[full - 1] if full else ROOT
            rest = tuple(tokens[full * bs : position])
            out.append(BlockRecord(state_keys.key(parent, rest), parent, namespace, rest, self.layout))
        return out

    def offer(
        self,
        keys: list[bytes],
        namespace: str,
        tokens: Sequence[int],
        position: int,
        read: Callable[[], list[torch.Tensor]],
    ) -> None:
        """The checkpoint after `tokens[:position]` joined the tree: every tier that lacks it gets a copy
        (written behind); `read()` gives the slot's state, called only if one does."""
        (record,) = self.records(keys, namespace, tokens, [position])
        missing = [t for t in self.lower.tiers if not t.contains(record.key)]
        if missing:
            packed = self.pack(read())
            for tier in missing:
                tier.store(record, packed)

    def read(
        self, namespace: str, tokens: Sequence[int], after: int, end: int, stop: Callable[[], bool]
    ) -> FoundState | None:
        """The newest checkpoint of `tokens` at a position in (after, end] that a tier holds intact, or
        None (on a loader's thread; a tier's error is a miss)."""
        low = max(after + 1, end - MAX_STATE_PROBES + 1, 1)
        if end < low:
            return None
        records = self.records([], namespace, tokens, range(end, low - 1, -1))
        names = [r.key for r in records]
        found = []
        for tier in self.lower.tiers:
            if stop():
                return None
            i = LowerTiers._or_miss("looking up a state checkpoint", tier.find, names)
            if i is not None:
                found.append((i, tier))
        for i, tier in sorted(found, key=lambda f: f[0]):
            if stop():
                return None
            shape = (self.num_bytes,)
            packed = LowerTiers._or_miss(
                "loading a state checkpoint", tier.load, records[i], shape, torch.uint8
            )
            if packed is not None:
                return FoundState(end - i, tier.name, packed)
        return None

    def pack(self, state: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in state])

    def unpack(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """The slot's tensors from `pack`'s bytes (already of the layout's size: the tier checked it)."""
        out, at = [], 0
        for shape, dtype in self._tensors:
            n = dtype.itemsize * _numel(shape)
            out.append(packed[at : at + n].clone().view(dtype).reshape(shape))
            at += n
        return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
