"""Recurrent layers: the interface a layer that keeps a fixed-size state per sequence implements, and the
state memory every such layer reads and writes.

A hybrid model's layers mix tokens either with attention over the KV cache or with a `RecurrentMixer`
(LFM2's gated short convolution, kvserve.model.short_conv; Qwen3.5's Gated DeltaNet; Mamba-2). A mixer's
state per sequence is the fixed-size tensors its `StateSpec` names; `RecurrentState` holds them for every
recurrent layer in slots. A slot is a sequence's live state or a checkpoint the prefix cache keeps (the
cache's `StatePool` hands the slot ids out); the forward pass reads and writes live slots only, and the
runner applies the copies the cache asks for (`RecurrentState.apply`) before each step.

Slot 0 is scratch: rows with no sequence slot (the startup probe's) read and write it, and no cache
decision ever points at it.

A new recurrent family plugs in without touching the forward pass, the engine or the cache: a mixer
kind in `kvserve.model.spec.MIXERS` named per layer by `ModelConfig.mixers`, and in its `Family` a
`mixer` builder (the layer's RecurrentMixer from its weights) and a `state_spec` (the layer's StateSpec
as the config makes it, which sizes the pool; a mixer whose own spec disagrees is refused at load).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.model.spec import MIXER_ATTENTION, ModelConfig

# The slot rows use when they belong to no sequence; never handed out by the cache.
SCRATCH_SLOT = 0
# A state copy whose source is this zeroes its destination (a sequence with no prior state).
ZERO = -1


@dataclass(frozen=True)
class StateSpec:
    """One recurrent layer's state per sequence: fixed-size tensors (e.g. a conv window [C, K-1], a
    delta-rule state [H, Dk, Dv])."""

    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype

    @property
    def num_bytes(self) -> int:
        """One sequence's state of this layer, in bytes."""
        size = torch.empty(0, dtype=self.dtype).element_size()
        return sum(size * _numel(shape) for shape in self.shapes)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class SequenceRows:
    """The batch's rows by sequence: sequence j owns rows [starts[j], starts[j+1]) of x, in token order,
    and state slot slots[j]; a slot of a sequence with no prior state reads zeros (the pool zeroes it).
    `decodes` is the step's number of decode rows (the first rows), as the products take it."""

    starts: torch.Tensor  # int64 [S+1]
    slots: torch.Tensor  # int64 [S]
    decodes: int = 0

    @property
    def num_sequences(self) -> int:
        return int(self.slots.shape[0])


class RecurrentMixer(Protocol):
    spec: StateSpec

    def forward(self, x: torch.Tensor, rows: SequenceRows, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """x [T, hidden] (after the layer's input norm) -> [T, hidden]; states[i] is
        [num_slots, *spec.shapes[i]] and each sequence's slot is left holding the state after its last
        row. Prefill uses a chunked or vectorized form, never a per-token Python loop; a one-row sequence
        updates in place."""
        ...


class StateShapeError(ValueError):
    """A state whose shapes disagree with what the model's config makes them."""


class RecurrentState:
    """Every recurrent layer's state in `num_slots` slots: for layer i with spec s, one tensor
    [num_slots, *shape] per shape of s (zeroed), none for an attention layer (spec None)."""

    def __init__(self, specs: Sequence[StateSpec | None], num_slots: int, device: torch.device) -> None:
        if num_slots < 1:
            raise ValueError("a recurrent state needs at least its scratch slot")
        self.num_slots = num_slots
        self.specs = tuple(specs)
        self._layers: list[tuple[torch.Tensor, ...]] = [
            ()
            if spec is None
            else tuple(
                torch.zeros((num_slots, *shape), dtype=spec.dtype, device=device) for shape in spec.shapes
            )
            for spec in self.specs
        ]

    @property
    def bytes_per_slot(self) -> int:
        """One sequence's state over every recurrent layer, in bytes."""
        return sum(spec.num_bytes for spec in self.specs if spec is not None)

    def layer(self, i: int) -> tuple[torch.Tensor, ...]:
        return self._layers[i]

    def apply(self, copies: Sequence[tuple[int, int]]) -> None:
        """Run the cache's state copies in order: (src, dst) copies slot src onto dst in every layer;
        src ZERO zeroes dst."""
        for src, dst in copies:
            for tensors in self._layers:
                for t in tensors:
                    if src == ZERO:
                        t[dst].zero_()
                    else:
                        t[dst] = t[src]

    def read_slot(self, slot: int) -> list[torch.Tensor]:
        """A CPU copy of one slot's state, every recurrent layer's tensors in layer order."""
        return [t[slot].to("cpu", copy=True) for tensors in self._layers for t in tensors]

    def write_slot(self, slot: int, state: Sequence[torch.Tensor]) -> None:
        """Overwrite one slot with `state` as `read_slot` returns it; raises StateShapeError, writing
        nothing, where a tensor's count, shape or dtype disagrees with the config's specs."""
        expected = [(shape, spec.dtype) for spec in self.specs if spec is not None for shape in spec.shapes]
        if len(state) != len(expected):
            raise StateShapeError(f"a state of {len(state)} tensors; this model's has {len(expected)}")
        for t, (shape, dtype) in zip(state, expected, strict=True):
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise StateShapeError(
                    f"a state tensor of shape {list(t.shape)} ({t.dtype}); this model's config makes it "
                    f"{list(shape)} ({dtype})"
                )
        tensors = [t for ts in self._layers for t in ts]
        for dst, src in zip(tensors, state, strict=True):
            dst[slot] = src.to(dst.device)


def state_specs(config: ModelConfig, dtype: torch.dtype) -> list[StateSpec | None]:
    """Each layer's recurrent state as the config makes it (None: an attention layer)."""
    from kvserve.model.families import family_named

    if not config.hybrid:
        return [None] * config.num_layers
    make = family_named(config.architecture).state_spec
    if make is None:
        raise StateShapeError(f"the {config.architecture} family names no recurrent state")
    return [
        None if config.mixer(i) == MIXER_ATTENTION else make(config, i, dtype)
        for i in range(config.num_layers)
    ]


def sequence_rows(lengths: Sequence[int], slots: Sequence[int], decodes: int = 0) -> SequenceRows:
    """SequenceRows of sequences with `lengths` rows each, in order, in state `slots`."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return SequenceRows(
        torch.tensor(starts, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64), decodes
    )
