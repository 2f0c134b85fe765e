"""Weights kept as the GGUF file's blocks, in the types the native kernels read in place.

A `QuantizedWeight` is a matrix [out, in] stored as `out` rows of `row_bytes` bytes, byte for byte as in
the file (kernels/decode.h reads each type's fields): the quantized types of llama.cpp's standard presets
(blocks of 32: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL; super-blocks of 256: Q2_K .. Q6_K, IQ4_XS), gpt-oss's
MXFP4 (blocks of 32: an E8M0 scale byte and 16 bytes of e2m1 codes) and the float matrices (F32, F16,
BF16). The rows are never written: they may be a view into the file's mapping.
Weights from a GGUF keep the file's blocks; `quantize_q8_0` makes Q8_0 blocks from float weights (for
`weight_dtype="q8_0"`). Any other type (IQ1/IQ2/IQ3, TQ, NVFP4, ...) is refused where a QuantizedWeight is
made, naming the type.

`QuantizedParts` is several such matrices over the same inputs, their outputs side by side (q, k and v of
different types in one product): nothing is copied.
"""

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.model.ggml_types import GEOMETRY, GgmlType

# ggml's type ids of the types the kernels read.
F32, F16, BF16 = GgmlType.F32, GgmlType.F16, GgmlType.BF16
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = GgmlType.Q4_0, GgmlType.Q4_1, GgmlType.Q5_0, GgmlType.Q5_1, GgmlType.Q8_0
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = GgmlType.Q2_K, GgmlType.Q3_K, GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K
IQ4_NL, IQ4_XS, MXFP4 = GgmlType.IQ4_NL, GgmlType.IQ4_XS, GgmlType.MXFP4
QK = 32
QK_K = 256

# Per type: (weights per block, bytes per block), as ggml lays them out.
BLOCK_SIZES: dict[int, tuple[int, int]] = {
    t: GEOMETRY[t]
    for t in (
        F32,
        F16,
        BF16,
        Q4_0,
        Q4_1,
        Q5_0,
        Q5_1,
        Q8_0,
        IQ4_NL,
        Q2_K,
        Q3_K,
        Q4_K,
        Q5_K,
        Q6_K,
        IQ4_XS,
        MXFP4,
    )
}
TYPE_NAMES = {t: GgmlType(t).name for t in BLOCK_SIZES}


def type_name(qtype: int) -> str:
    """The ggml name of a type id (the gguf package's, for a type newer than `GgmlType`)."""
    if qtype in GEOMETRY:
        return GgmlType(qtype).name
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(qtype).name
    except ValueError:
        return f"unknown type {qtype}"


def row_unit(qtype: int) -> int:
    """The row lengths a type allows are multiples of this (the kernels read 32 weights at a time)."""
    return max(BLOCK_SIZES[qtype][0], QK)


def row_bytes(qtype: int, in_features: int) -> int:
    elems, nbytes = BLOCK_SIZES[qtype]
    return in_features // elems * nbytes


@dataclass(frozen=True)
class QuantizedWeight:
    """`data` uint8 [out, row_bytes] of ggml type `qtype` (read only)."""

    qtype: int
    data: torch.Tensor
    in_features: int

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_SIZES:
            raise ValueError(f"weights of type {type_name(self.qtype)} are not read by kvserve's kernels")
        unit = row_unit(self.qtype)
        if self.in_features <= 0 or self.in_features % unit:
            raise ValueError(
                f"{type_name(self.qtype)} rows need a multiple of {unit} weights, not {self.in_features}"
            )
        if self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError("quantized weights need uint8 rows [out, row bytes]")
        if self.data.shape[1] != row_bytes(self.qtype, self.in_features) or self.data.stride(1) != 1:
            raise ValueError(f"rows of {self.data.shape[1]} bytes do not hold {self.in_features} weights")
        if self.data.shape[0] > 1 and self.data.stride(0) != self.data.shape[1]:
            raise ValueError("quantized weights need their rows contiguous")

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    @property
    def parts(self) -> tuple["QuantizedWeight", ...]:
        return (self,)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` dequantized to float32 [*index.shape, in], by the gguf package (the reference:
        QuantLinear.rows reads them natively)."""
        picked = self.data.index_select(0, index.reshape(-1))
        return dequantize_rows(picked, self.qtype, self.in_features).reshape(*index.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features))


@dataclass(frozen=True)
class QuantizedParts:
    """Matrices over the same inputs whose outputs are concatenated, each of its own type."""

    parts: tuple[QuantizedWeight, ...]

    def __post_init__(self) -> None:
        if not self.parts or any(p.in_features != self.parts[0].in_features for p in self.parts):
            raise ValueError("the parts of a product need the same inputs")

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def qtype(self) -> int | None:
        """The parts' type where they share one."""
        types = {p.qtype for p in self.parts}
        return types.pop() if len(types) == 1 else None

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        return self.dequantize()[index]

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


Blocks = QuantizedWeight | QuantizedParts


def dequantize_rows(data: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """uint8 rows [n, row bytes] of `qtype` as float32 [n, in], by the gguf package's dequantization."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = data.contiguous().numpy().reshape(-1, row_bytes(qtype, in_features))
    values = np.asarray(dequantize(raw, GGMLQuantizationType(qtype)), dtype=np.float32)
    return torch.from_numpy(values.reshape(-1, in_features).copy())


def concat(weights: list[QuantizedWeight]) -> Blocks | None:
    """The product of the weights' outputs side by side (q, k and v as one call), without a copy; None
    where their inputs differ."""
    if any(w.in_features != weights[0].in_features for w in weights):
        return None
    return weights[0] if len(weights) == 1 else QuantizedParts(tuple(weights))


def quantize_q8_0(weight: torch.Tensor) -> QuantizedWeight:
    """Float weights [out, in] as Q8_0 blocks: per 32 weights, d = max |w| / 127 (stored in float16) and
    q = round(w / d), as ggml quantizes."""
    out, n_in = weight.shape
    if n_in % QK:
        raise ValueError(f"Q8_0 needs rows of whole blocks of 32, not {n_in}")
    w = weight.detach().float().cpu().reshape(out, n_in // QK, QK)
    d = w.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = (w * inv).round().clamp(-127, 127).to(torch.int8)
    blocks = torch.cat((d.to(torch.float16).view(torch.uint8), q.view(torch.uint8)), dim=-1)
    return QuantizedWeight(Q8_0, blocks.reshape(out, -1).contiguous(), n_in)
