"""A recurrent layer's one-row sequences through the native step (`mixer_rows` in kernels/decoder.c), the
function the one-call native decoder runs for them: on the per-op path as well, so that a decode's state
and output have the same bits whichever path ran it, and in any batch (each row is computed on its own).
The other sequences of a step (prefill chunks, a decode with its drafts) take the mixer's torch form.
"""

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvserve.model.kernel_abi import MixerStruct
from kvserve.model.linear import Linear
from kvserve.model.quant_linear import QuantLinear
from kvserve.model.recurrent import SequenceRows, sequence_rows


@dataclass(frozen=True)
class NativeStep:
    """A mixer's native step: the kernel library and the step's description (pointers into the mixer's
    tensors, which the mixer keeps alive)."""

    lib: ctypes.CDLL
    struct: MixerStruct


def native_library(products: Sequence[Linear], tensors: Sequence[torch.Tensor]) -> ctypes.CDLL | None:
    """The kernel library where every product is native and the small tensors float32 on the CPU."""
    if not all(isinstance(p, QuantLinear) for p in products):
        return None
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return None
    first = products[0]
    assert isinstance(first, QuantLinear)
    return first.lib


def _run(
    step: NativeStep,
    states: tuple[torch.Tensor, ...],
    inputs: Sequence[torch.Tensor],
    slots: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """mixer_rows on rows `inputs` (the input product's, then z, b and a for the DeltaNet), [rows, width]."""
    args = [t.float().contiguous() for t in inputs]
    slots = slots.contiguous()
    out = torch.empty((args[0].shape[0], width), dtype=torch.float32)
    pointers = [t.data_ptr() for t in args] + [None] * (4 - len(args))
    status = step.lib.mixer_rows(
        ctypes.byref(step.struct),
        states[0].data_ptr(),
        states[1].data_ptr() if len(states) > 1 else None,
        *pointers,
        out.shape[0],
        slots.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status == -2:
        raise MemoryError("the native recurrent step could not allocate its scratch memory")
    if status != 0:
        raise ValueError("the native recurrent step refused this layer's shapes")
    return out


def mix(
    step: NativeStep | None,
    torch_rows: Callable[[list[torch.Tensor], SequenceRows], torch.Tensor],
    inputs: list[torch.Tensor],
    rows: SequenceRows,
    states: tuple[torch.Tensor, ...],
    width: int,
) -> torch.Tensor:
    """The mixer's output [T, width] of its step inputs (each [T, ...]): the one-row sequences through
    `step` (where there is one and the states are float32 and contiguous), the others through
    `torch_rows(their inputs, their rows)`."""
    native = step is not None and all(s.dtype == torch.float32 and s.is_contiguous() for s in states)
    starts = rows.starts.tolist()
    lengths = [starts[j + 1] - starts[j] for j in range(rows.num_sequences)]
    single = [j for j, n in enumerate(lengths) if n == 1] if native else []
    if not single:
        return torch_rows(inputs, rows)
    assert step is not None
    if len(single) == len(lengths):
        return _run(step, states, inputs, rows.slots, width)
    others = [j for j, n in enumerate(lengths) if n != 1]
    single_rows = torch.tensor([starts[j] for j in single])
    other_rows = torch.tensor([r for j in others for r in range(starts[j], starts[j + 1])])
    out = torch.empty((inputs[0].shape[0], width), dtype=torch.float32)
    out[single_rows] = _run(step, states, [t[single_rows] for t in inputs], rows.slots[single], width)
    other = sequence_rows([lengths[j] for j in others], rows.slots[others].tolist())
    out[other_rows] = torch_rows([t[other_rows] for t in inputs], other).float()
    return out
