"""Paged attention on portable torch ops (any device): write the step's K/V into cache slots, then attend.

The KV cache (in the compute dtype, or float16 under float32) is one tensor per layer and per K/V, of
shape [num_blocks * block_size, kv_heads, head_dim] (slot = block * block_size + offset). Reads gather
whole blocks, which is a few large copies instead of one small copy per token. A step's tokens are laid
out decodes first, then one span per prefill chunk; index and mask tensors are built once per step
(AttentionMetadata) and shared by every layer.

Decodes and prefill tokens run through the native kernel (kvserve.model.native_attention) when the runner
has one: it reads each row's blocks in place, unpadded, and is bitwise batch-invariant, and a prefill
token is the same row as its decode would be. The portable path gathers the
decodes' blocks into one padded batch for SDPA; grouped-query attention there copies no K/V: the query
heads that share a KV head are laid along the query-length axis, so one SDPA call serves the whole group.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.model import huge_pages
from kvserve.model.native_attention import NativeDecodeAttention


@dataclass
class PrefillSpan:
    """Tokens [start, end) of the step are one request's prefill chunk.

    With the native kernel, `tables` [chunk, blocks] and `lens` [chunk] make each token one of its rows
    (its sequence's blocks, its own position + 1), exactly as that token's decode would be: a token's
    attention then has the same bits whether its step was a prefill or a decode. Otherwise, when the chunk
    continues a sequence, `context_blocks` lists the blocks of all its tokens so far (`context_len` of
    them count) and `mask` [chunk * query heads per KV head, context_len] is the causal mask against them,
    one row per (token, head in group); both are None when the chunk starts the sequence, so attention
    runs on the fresh K/V directly.
    """

    start: int
    end: int
    context_blocks: torch.Tensor | None = None
    context_len: int = 0
    mask: torch.Tensor | None = None
    tables: torch.Tensor | None = None
    lens: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """`decode_tables` [decodes, max_blocks], `decode_lens` [decodes] and `decode_len` (the longest)
    describe the decodes. With `native` set the kernel runs them; otherwise `decode_mask`
    [decodes, 1, 1, decode_len] masks the padding, None when every decode has the same context length."""

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_tables: torch.Tensor | None
    decode_len: int
    decode_mask: torch.Tensor | None
    prefills: list[PrefillSpan]
    decode_lens: torch.Tensor | None = None
    native: NativeDecodeAttention | None = None


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
        self.dtype = dtype
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = huge_pages.empty(shape, dtype, device).zero_()
        self.v = huge_pages.empty(shape, dtype, device).zero_()

    def copy_block(self, src: int, dst: int) -> None:
        bs = self.block_size
        self.k[:, dst * bs : (dst + 1) * bs] = self.k[:, src * bs : (src + 1) * bs]
        self.v[:, dst * bs : (dst + 1) * bs] = self.v[:, src * bs : (src + 1) * bs]

    def read_block(self, block: int) -> torch.Tensor:
        """A CPU copy of one block's K and V in every layer, [2, layers, block_size, kv_heads, head_dim].

        The copy's layout is the exchange format of the cache tiers, whatever the cache's own layout, so
        that a block written by one layout reads back under another.
        """
        bs = self.block_size
        rows = slice(block * bs, (block + 1) * bs)
        return torch.stack((self.k[:, rows], self.v[:, rows])).to("cpu", copy=True)

    def write_block(self, block: int, data: torch.Tensor) -> None:
        """Overwrite one block's K and V with `data` as `read_block` returns it."""
        bs = self.block_size
        rows = slice(block * bs, (block + 1) * bs)
        self.k[:, rows] = data[0].to(self.k.device)
        self.v[:, rows] = data[1].to(self.v.device)

    def block_shape(self) -> tuple[int, ...]:
        """The shape of `read_block`'s result."""
        return (2, self.k.shape[0], self.block_size, self.k.shape[2], self.k.shape[3])


def _gather(cache: torch.Tensor, blocks: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Blocks [..., n] of a layer's cache -> [..., n * block_size, kv_heads, head_dim] in `dtype`."""
    heads, dim = cache.shape[1], cache.shape[2]
    paged = cache.view(-1, block_size, heads, dim)
    return paged.index_select(0, blocks.reshape(-1)).view(*blocks.shape[:-1], -1, heads, dim).to(dtype)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] for this step; k_cache/v_cache [slots, Hkv, D] of one layer.

    Returns the attention output [T, Hq, D].
    """
    if k_cache.dtype != k.dtype:
        # A lower-precision cache: attend to the values it holds everywhere, the fresh prefill's own K/V
        # included, so that a token's output is the same whether its context was just computed or cached.
        k_stored, v_stored = k.to(k_cache.dtype), v.to(v_cache.dtype)
        k_cache.index_copy_(0, meta.slot_mapping, k_stored)
        v_cache.index_copy_(0, meta.slot_mapping, v_stored)
        # Only SDPA over a chunk that starts its sequence reads the fresh K/V; the kernel reads the cache.
        if any(span.tables is None and span.context_blocks is None for span in meta.prefills):
            k, v = k_stored.to(q.dtype), v_stored.to(q.dtype)
    else:
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    group = heads // kv_heads
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd and meta.native is not None:
        assert meta.decode_tables is not None and meta.decode_lens is not None
        out[:nd] = meta.native(
            q[:nd], k_cache, v_cache, meta.decode_tables, meta.decode_lens, block_size, scale
        )
    elif nd:
        assert meta.decode_tables is not None
        length = meta.decode_len
        kd = _gather(k_cache, meta.decode_tables, block_size, q.dtype)[:, :length].transpose(1, 2)
        vd = _gather(v_cache, meta.decode_tables, block_size, q.dtype)[:, :length].transpose(1, 2)
        qd = q[:nd].view(nd, kv_heads, group, dim)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        out[:nd] = od.reshape(nd, heads, dim)
    for span in meta.prefills:
        n = span.end - span.start
        if span.tables is not None:
            # The runner sets a span's rows only when it has the kernel.
            assert meta.native is not None and span.lens is not None
            out[span.start : span.end] = meta.native(
                q[span.start : span.end], k_cache, v_cache, span.tables, span.lens, block_size, scale
            )
            continue
        if span.context_blocks is None:
            # The CPU flash kernel wants contiguous 4-D [1, heads, len, dim] inputs with equal head counts.
            qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0).contiguous()
            ks = k[span.start : span.end].transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
            vs = v[span.start : span.end].transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
            os_ = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
            out[span.start : span.end] = os_[0].transpose(0, 1)
            continue
        # A chunk after cached context: as for decodes, the queries of a KV group share its keys, laid
        # along the query axis (mask rows follow), so the long context is never copied per query head.
        qs = (
            q[span.start : span.end]
            .view(n, kv_heads, group, dim)
            .permute(1, 0, 2, 3)
            .reshape(1, kv_heads, -1, dim)
        )
        ks = (
            _gather(k_cache, span.context_blocks, block_size, q.dtype)[: span.context_len]
            .transpose(0, 1)
            .unsqueeze(0)
        )
        vs = (
            _gather(v_cache, span.context_blocks, block_size, q.dtype)[: span.context_len]
            .transpose(0, 1)
            .unsqueeze(0)
        )
        os_ = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask, scale=scale)
        out[span.start : span.end] = (
            os_[0].view(kv_heads, n, group, dim).permute(1, 0, 2, 3).reshape(n, heads, dim)
        )
    return out
