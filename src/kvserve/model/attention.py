"""Paged attention on portable torch ops (any device): write the step's K/V into cache slots, then attend.

The KV cache is one tensor per layer and per K/V, of shape [num_slots, kv_heads, head_dim], where slot =
block * block_size + offset. A step's tokens are laid out decodes first, then one span per prefill chunk.
All index and mask tensors are built once per step (AttentionMetadata) and shared by every layer.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """Tokens [start, end) of the step are one request's prefill chunk.

    `context_slots` lists the cache slots of all its tokens so far (earlier ones included) and `mask` is
    the causal mask against them; both are None when the chunk starts the sequence, so attention can
    run on the fresh K/V directly.
    """

    start: int
    end: int
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_slots: torch.Tensor | None
    decode_mask: torch.Tensor | None
    prefills: list[PrefillSpan]


class KVCache:
    """Preallocated paged K/V memory for every layer."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        self.k[:, dst * bs : (dst + 1) * bs] = self.k[:, src * bs : (src + 1) * bs]
        self.v[:, dst * bs : (dst + 1) * bs] = self.v[:, src * bs : (src + 1) * bs]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] for this step; k_cache/v_cache [slots, Hkv, D] of one layer.

    Returns the attention output [T, Hq, D].
    """
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        assert meta.decode_slots is not None
        batch, length = meta.decode_slots.shape
        flat = meta.decode_slots.view(-1)
        kd = k_cache.index_select(0, flat).view(batch, length, k.shape[1], k.shape[2]).transpose(1, 2)
        vd = v_cache.index_select(0, flat).view(batch, length, v.shape[1], v.shape[2]).transpose(1, 2)
        od = F.scaled_dot_product_attention(
            q[:nd].unsqueeze(2), kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True
        )
        out[:nd] = od.squeeze(2)
    for span in meta.prefills:
        qs = q[span.start : span.end].transpose(0, 1)
        if span.context_slots is None:
            ks = k[span.start : span.end].transpose(0, 1)
            vs = v[span.start : span.end].transpose(0, 1)
            os_ = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            ks = k_cache.index_select(0, span.context_slots).transpose(0, 1)
            vs = v_cache.index_select(0, span.context_slots).transpose(0, 1)
            os_ = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask, scale=scale, enable_gqa=True)
        out[span.start : span.end] = os_.transpose(0, 1)
    return out
