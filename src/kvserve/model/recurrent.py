"""The interface of a recurrent layer (a mixer whose per-sequence state has a fixed size), which the
Transformer dispatches to per layer and whose state the state pool holds."""

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class StateSpec:
    """One recurrent layer's state per sequence: fixed-size tensors (e.g. a conv window [C, K-1], a
    delta-rule state [H, Dk, Dv])."""

    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class SequenceRows:
    """The batch's rows by sequence: sequence j owns rows [starts[j], starts[j+1]) of x, in token order,
    and state slot slots[j]; a slot of a sequence with no prior state reads zeros (the pool zeroes it)."""

    starts: torch.Tensor  # int64 [S+1]
    slots: torch.Tensor  # int64 [S]


class RecurrentMixer(Protocol):
    spec: StateSpec

    def forward(self, x: torch.Tensor, rows: SequenceRows, states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """x [T, hidden] (after the layer's input norm) -> [T, hidden]; states[i] is
        [num_slots, *spec.shapes[i]] and each sequence's slot is left holding the state after its last
        row. Prefill uses a chunked or vectorized form, never a per-token Python loop; a one-row sequence
        updates in place."""
        ...
