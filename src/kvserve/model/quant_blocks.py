"""Weights kept as quantized blocks of 32 (GGUF's Q8_0, Q4_0 and Q4_1), as the native kernel reads them.

The K-quants (Q4_K, Q5_K and Q6_K: super-blocks of 256 with 6- or 8-bit sub-block scales) are converted
once at load to K8, kvserve's own block of 32: float32 scales for each half, a float32 offset, and the
quants as int8. The scales are computed from the file's fields exactly as ggml computes them, so a K8
block holds the same weights to the bit (11 bits a weight instead of 4.5 to 6.6, still under float16's).

A `QuantizedWeight` is a matrix [out, in] stored as `out` rows of `in / 32` blocks, byte for byte as in
the GGUF file (see kernels/quants.h for the block layouts). Weights from a GGUF keep the file's
blocks; `quantize_q8_0` makes Q8_0 blocks from float weights (for `weight_dtype="q8_0"`).
"""

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.model.gguf_file import block_geometry as ggml_geometry
from kvserve.model.gguf_file import dequantize as ggml_dequantize

# ggml's type ids, and the bytes of one block of 32 weights.
Q4_0 = 2
Q4_1 = 3
Q8_0 = 8
Q4_K = 12
Q5_K = 13
Q6_K = 14
# kvserve's own type id for converted K-quants (see kernels/quants.h).
K8 = 100
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34, K8: 44}
K_QUANTS = (Q4_K, Q5_K, Q6_K)
QK = 32
QK_K = 256


def block_geometry(qtype: int) -> tuple[int, int]:
    """(weights per block, bytes per block) of kvserve's K8 or any ggml type."""
    if qtype in BLOCK_BYTES:
        return QK, BLOCK_BYTES[qtype]
    geometry = ggml_geometry(qtype)
    if geometry is None:
        raise ValueError(f"unsupported block type {qtype}")
    return geometry


@dataclass(frozen=True)
class QuantizedWeight:
    """`data` uint8 [out, in / block weights * block bytes] of blocks of ggml type `qtype`: any ggml type
    a GGUF holds (the native kernel reads those of BLOCK_BYTES)."""

    qtype: int
    data: torch.Tensor
    in_features: int

    def __post_init__(self) -> None:
        block, block_bytes = block_geometry(self.qtype)
        if self.in_features % block or self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError(f"quantized weights need uint8 rows of whole blocks of {block}")
        if self.data.shape[1] != self.in_features // block * block_bytes:
            raise ValueError(f"rows of {self.data.shape[1]} bytes do not hold {self.in_features} weights")

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` dequantized to float32 [*index.shape, in] (embedding lookups)."""
        picked = self.data.index_select(0, index.reshape(-1))
        return dequantize_rows(picked, self.qtype, self.in_features).reshape(*index.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features))


def dequantize_rows(data: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """uint8 rows of blocks [n, in / 32 * block bytes] of `qtype` as float32 [n, in]; the types the
    kernel does not read through the gguf package's dequantizer."""
    if qtype not in BLOCK_BYTES:
        return torch.from_numpy(ggml_dequantize(data.numpy(), qtype)).reshape(-1, in_features)
    blocks = data.reshape(-1, in_features // QK, BLOCK_BYTES[qtype])
    if qtype == K8:
        scales = blocks[..., :12].contiguous().view(torch.float32)
        q = blocks[..., 12:].contiguous().view(torch.int8).float().view(*blocks.shape[:-1], 2, 16)
        w = q * scales[..., :2].unsqueeze(-1) + scales[..., 2:3].unsqueeze(-1)
        return w.reshape(-1, in_features)
    d = blocks[..., :2].contiguous().view(torch.float16).float()
    if qtype == Q8_0:
        w = blocks[..., 2:].contiguous().view(torch.int8).float() * d
    else:
        qs = blocks[..., 4:] if qtype == Q4_1 else blocks[..., 2:]
        q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()
        if qtype == Q4_0:
            w = (q - 8) * d
        else:
            w = q * d + blocks[..., 2:4].contiguous().view(torch.float16).float()
    return w.reshape(-1, in_features)


def concat(weights: list[QuantizedWeight]) -> QuantizedWeight | None:
    """The row-wise concatenation (q, k and v into one product), or None when the types differ."""
    first = weights[0]
    if any(w.qtype != first.qtype or w.in_features != first.in_features for w in weights):
        return None
    if len(weights) == 1:
        # No copy: the model's products hold their blocks as loaded.
        return first
    return QuantizedWeight(first.qtype, torch.cat([w.data for w in weights]), first.in_features)


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


def from_k_quant(raw: np.ndarray, qtype: int, in_features: int) -> QuantizedWeight:
    """K8 blocks holding the same weights as `raw` ([out, bytes] of Q4_K, Q5_K or Q6_K super-blocks).

    The scales and offsets are ggml's own products (float16 field times integer scale, in float32); the
    quants are the gguf package's dequantization of the same super-blocks with unit scales.
    """
    from gguf import GGMLQuantizationType
    from gguf.quants import Q4_K as GgufQ4K
    from gguf.quants import dequantize

    out = raw.shape[0]
    supers = raw.reshape(out * (in_features // QK_K), -1)
    n = supers.shape[0]
    if qtype == Q6_K:
        # ql[128], qh[64], int8 scales[16] (one per 16 weights), float16 d.
        d = supers[:, 208:210].copy().view(np.float16).astype(np.float32)
        scale16 = d * supers[:, 192:208].copy().view(np.int8).astype(np.float32)
        scale = scale16.reshape(n, 8, 2)
        offset = np.zeros((n, 8, 1), dtype=np.float32)
    elif qtype in (Q4_K, Q5_K):
        # float16 d and dmin, then 12 bytes of eight 6-bit scales and mins (one each per 32 weights).
        d = supers[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = supers[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = GgufQ4K.get_scale_min(supers[:, 4:16].copy())
        scale32 = d * sc.astype(np.float32)
        scale = np.repeat(scale32[:, :, None], 2, axis=2)
        offset = -(dmin * mn.astype(np.float32))[:, :, None]
    else:
        raise ValueError(f"not a K-quant type: {qtype}")
    # The quants themselves: the same super-blocks with unit scales and no offsets dequantize to them.
    unit = supers.copy()
    if qtype == Q6_K:
        unit[:, 192:208] = 1
        unit[:, 208:210] = np.array([1.0], dtype=np.float16).view(np.uint8)
    else:
        unit[:, 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
        unit[:, 2:4] = 0
        unit[:, 4:8], unit[:, 8:12], unit[:, 12:16] = 1, 0, 1
    q = np.asarray(dequantize(unit, GGMLQuantizationType(qtype)), dtype=np.float32).reshape(n, 8, 32)
    blocks = np.concatenate(
        [
            scale.astype(np.float32).view(np.uint8),
            offset.astype(np.float32).view(np.uint8),
            q.astype(np.int8).view(np.uint8),
        ],
        axis=-1,
    )
    return QuantizedWeight(K8, torch.from_numpy(np.ascontiguousarray(blocks.reshape(out, -1))), in_features)
