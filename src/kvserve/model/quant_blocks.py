"""Weights kept as quantized blocks of 32 (GGUF's Q8_0, Q4_0 and Q4_1), as the native kernel reads them.

A `QuantizedWeight` is a matrix [out, in] stored as `out` rows of `in / 32` blocks, byte for byte as in
the GGUF file (see kernels/quant_linear.c for the block layouts). Weights from a GGUF keep the file's
blocks; `quantize_q8_0` makes Q8_0 blocks from float weights (for `weight_dtype="q8_0"`).
"""

from dataclasses import dataclass

import torch

# ggml's type ids, and the bytes of one block of 32 weights.
Q4_0 = 2
Q4_1 = 3
Q8_0 = 8
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
TYPE_NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}
QK = 32


@dataclass(frozen=True)
class QuantizedWeight:
    """`data` uint8 [out, in / 32 * block bytes] of blocks of ggml type `qtype`."""

    qtype: int
    data: torch.Tensor
    in_features: int

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"unsupported block type {self.qtype}")
        if self.in_features % QK or self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError("quantized weights need uint8 rows of whole blocks of 32")
        if self.data.shape[1] != self.in_features // QK * BLOCK_BYTES[self.qtype]:
            raise ValueError(f"rows of {self.data.shape[1]} bytes do not hold {self.in_features} weights")

    @property
    def out_features(self) -> int:
        return int(self.data.shape[0])

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` dequantized to float32 [len(index), in] (embedding lookups)."""
        blocks = self.data.index_select(0, index.reshape(-1)).view(
            -1, self.in_features // QK, BLOCK_BYTES[self.qtype]
        )
        d = blocks[..., :2].contiguous().view(torch.float16).float()
        if self.qtype == Q8_0:
            w = blocks[..., 2:].contiguous().view(torch.int8).float() * d
        else:
            qs = blocks[..., 4:] if self.qtype == Q4_1 else blocks[..., 2:]
            q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()
            if self.qtype == Q4_0:
                w = (q - 8) * d
            else:
                w = q * d + blocks[..., 2:4].contiguous().view(torch.float16).float()
        return w.reshape(*index.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features))


def concat(weights: list[QuantizedWeight]) -> QuantizedWeight | None:
    """The row-wise concatenation (q, k and v into one product), or None when the types differ."""
    first = weights[0]
    if any(w.qtype != first.qtype or w.in_features != first.in_features for w in weights):
        return None
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
