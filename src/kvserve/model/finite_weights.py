"""Weights holding NaN or infinity are refused at load: such a model serves NaN logits (or one token
forever) and cannot be told from a broken engine by its replies.

A GGUF is checked in place, without dequantizing it: a float tensor's every value (its exponent bits,
read through a view), and a quantized tensor's block scales (the f16 `d` and `dmin` fields of every
block, read through a strided view; the quants are small integers, so finite scales make finite
weights). MXFP4's scale is a power of two (its first byte): the largest code times it is finite below
the top three exponents (`_MXFP4_FINITE`), so only a tensor with a block there is dequantized, as IQ1_M
(whose scales are not plain floats) always is, a chunk at a time. Nothing is copied but one chunk's
comparison at a time. A safetensors tensor is checked as it is
read (`check_tensor`).
"""

from collections.abc import Iterator

import numpy as np
import torch

from kvserve.errors import ModelLoadError
from kvserve.model.ggml_types import GgmlType as T
from kvserve.model.gguf_file import GgufFile, TensorInfo, block_geometry, dequantizable, dequantize

# Values checked per numpy call: bounds the comparison's temporary (a few MiB).
_CHUNK = 1 << 20
# The exponent bits of each float width: all set is an infinity or a NaN.
_EXPONENTS = {2: 0x7C00, 4: 0x7F800000, 8: 0x7FF0000000000000}
_BF16_EXPONENT = 0x7F80
# The tensors whose every value is a float: (bytes per value, exponent mask).
_FLOATS: dict[int, tuple[int, int]] = {
    T.F32: (4, _EXPONENTS[4]),
    T.F16: (2, _EXPONENTS[2]),
    T.BF16: (2, _BF16_EXPONENT),
    T.F64: (8, _EXPONENTS[8]),
}
_INTEGERS = (T.I8, T.I16, T.I32, T.I64)
# MXFP4's scale byte e makes 2^(e - 128); its largest code, 12, times that overflows float32 from 253 on.
_MXFP4_FINITE = 252
# Where each block's float scales lie (byte offset, bytes), as ggml lays the blocks out.
_D = ((0, 2),)
_D_DMIN = ((0, 2), (2, 2))
_SCALES: dict[int, tuple[tuple[int, int], ...]] = {
    T.Q4_0: _D,
    T.Q4_1: _D_DMIN,
    T.Q5_0: _D,
    T.Q5_1: _D_DMIN,
    T.Q8_0: _D,
    T.Q2_K: ((80, 2), (82, 2)),
    T.Q3_K: ((108, 2),),
    T.Q4_K: _D_DMIN,
    T.Q5_K: _D_DMIN,
    T.Q6_K: ((208, 2),),
    T.IQ2_XXS: _D,
    T.IQ2_XS: _D,
    T.IQ2_S: _D,
    T.IQ3_XXS: _D,
    T.IQ3_S: _D,
    T.IQ1_S: _D,
    T.IQ4_NL: _D,
    T.IQ4_XS: _D,
    T.TQ1_0: ((52, 2),),
    T.TQ2_0: ((64, 2),),
}


def check_gguf(file: GgufFile) -> None:
    """Every tensor of `file` holds finite values; raises ModelLoadError naming the first that does not."""
    for t in file.tensors.values():
        if not _finite(file, t):
            raise ModelLoadError(file.path, f"tensor {t.name} holds NaN or infinity")


def _finite(file: GgufFile, t: TensorInfo) -> bool:
    if t.qtype in _FLOATS:
        width, mask = _FLOATS[t.qtype]
        values = file.array(t).reshape(-1).view(np.uint8).view(f"<u{width}")
        return _no_exponent_all_set(values, mask)
    if t.qtype in _SCALES:
        return all(
            _no_exponent_all_set(file.block_field(t, at, f"<u{width}"), _EXPONENTS[width])
            for at, width in _SCALES[t.qtype]
        )
    if t.qtype in _INTEGERS or not dequantizable(t.qtype):
        # Integers are finite; a type nothing reads is refused where the tensors are named.
        return True
    if t.qtype == T.MXFP4 and not (file.block_field(t, 0, "u1") > _MXFP4_FINITE).any():
        return True
    with np.errstate(invalid="ignore", over="ignore"):
        return all(np.isfinite(dequantize(rows, t.qtype)).all() for rows in _row_chunks(file, t))


def _no_exponent_all_set(values: np.ndarray, mask: int) -> bool:
    m = values.dtype.type(mask)
    return not any(((values[i : i + _CHUNK] & m) == m).any() for i in range(0, len(values), _CHUNK))


def _row_chunks(file: GgufFile, t: TensorInfo) -> Iterator[np.ndarray]:
    data = file.array(t).reshape(-1, t.row_bytes)
    geometry = block_geometry(t.qtype)
    assert geometry is not None
    rows = max(1, _CHUNK // (t.row_bytes // geometry[1] * geometry[0]))
    for i in range(0, len(data), rows):
        yield data[i : i + rows]


def check_tensor(where: str, name: str, tensor: torch.Tensor) -> None:
    """`tensor` (read from the file `where`) holds finite values; raises ModelLoadError naming it."""
    if not tensor.is_floating_point():
        return
    flat = tensor.reshape(-1)
    for i in range(0, flat.numel(), _CHUNK):
        if not bool(torch.isfinite(flat[i : i + _CHUNK]).all()):
            raise ModelLoadError(where, f"tensor {name} holds NaN or infinity")
