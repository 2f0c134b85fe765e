"""The KV cache's storage formats: float (float32, float16, ...) and q8_0, llama.cpp's `-ctk q8_0` layout.

A q8_0 cache stores each head's row of head_dim values as head_dim / 32 blocks of 34 bytes: a float16
scale d = max |x| / 127 over the block's 32 values, then their 32 int8 quants q = round(x / d) (half away
from zero, as C's roundf), so a value reads back as q * d. The cache tensors of a q8_0 cache are uint8,
[slots, kv_heads, head_dim / 32 * 34]: a uint8 cache holds q8_0 blocks (the one quantized format), which
is how the attention backends and the native kernels tell it apart. q * d is exact in float32 (8 bits
times 11), so every path that reads the cache (the C kernel, the portable backend) sees the same values.

Quantizing runs in float32 whatever the compute dtype (as llama.cpp does), in the same operations as
the native decoder's C writes (kernels/decoder.c), so a token's blocks have the same bytes whichever path
wrote them: d = amax / 127, the inverse 1 / d (0 for an all-zero block), x * (1 / d) rounded.
"""

import torch

from kvserve.config import COMPUTE_DTYPES
from kvserve.errors import ConfigError
from kvserve.model.spec import ModelConfig

Q8_0 = "q8_0"
# Values per block and a block's bytes (a float16 scale, then the int8 quants).
QK = 32
BLOCK_BYTES = 2 + QK
STORAGE = torch.uint8

_FLOATS: dict[str, torch.dtype] = {name: getattr(torch, name) for name in COMPUTE_DTYPES}


def storage_dtype(kv_dtype: str) -> torch.dtype:
    """The element type of the cache tensors of `kv_dtype` (one of config.KV_DTYPES, resolved)."""
    return STORAGE if kv_dtype == Q8_0 else _FLOATS[kv_dtype]


def row_width(kv_dtype: str, head_dim: int) -> int:
    """Elements of the cache tensors per head and position; refuses (ConfigError) a q8_0 cache of a
    head size its blocks do not divide."""
    if kv_dtype != Q8_0:
        return head_dim
    if head_dim % QK:
        raise ConfigError(
            f"--kv-dtype q8_0 stores blocks of {QK} values along a head, and this model's head_dim is "
            f"{head_dim}, not a multiple of {QK}: use --kv-dtype float16"
        )
    return head_dim // QK * BLOCK_BYTES


def kv_bytes_per_token(config: ModelConfig, kv_dtype: str) -> int:
    """The KV bytes of one token over every layer, K and V, in `kv_dtype`."""
    width = row_width(kv_dtype, config.head_dim) * storage_dtype(kv_dtype).itemsize
    return 2 * len(config.attention_layers) * config.num_kv_heads * width


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., dim] (dim a multiple of 32) -> its q8_0 blocks [..., dim / 32 * 34] uint8."""
    *lead, dim = x.shape
    blocks = x.float().reshape(*lead, dim // QK, QK)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inverse
    # roundf: half away from zero (torch.round takes halves to even). The fraction is exact.
    whole = scaled.trunc()
    quants = torch.where((scaled - whole).abs() >= 0.5, whole + scaled.sign(), whole).to(torch.int8)
    out = torch.empty(*lead, dim // QK, BLOCK_BYTES, dtype=STORAGE, device=x.device)
    out[..., :2] = d.half().view(STORAGE)
    out[..., 2:] = quants.view(STORAGE)
    return out.view(*lead, dim // QK * BLOCK_BYTES)


def dequantize(blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q8_0 blocks [..., width] uint8 -> their values [..., width / 34 * 32] in `dtype`."""
    *lead, width = blocks.shape
    b = blocks.reshape(*lead, width // BLOCK_BYTES, BLOCK_BYTES)
    d = b[..., :2].contiguous().view(torch.float16).float()
    values = b[..., 2:].contiguous().view(torch.int8).float() * d
    return values.reshape(*lead, width // BLOCK_BYTES * QK).to(dtype)


def store(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `cache_dtype` holds it: q8_0 blocks for a uint8 cache, else x rounded to it."""
    return quantize(x) if cache_dtype == STORAGE else x.to(cache_dtype)


def values(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a cache holds (`store`'s result, or rows read from the cache) as values in `dtype`."""
    return dequantize(stored, dtype) if stored.dtype == STORAGE else stored.to(dtype)
