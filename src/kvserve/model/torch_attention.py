"""Paged attention on portable torch ops (any device): gather the context's blocks, then SDPA.

Reads gather whole blocks, which is a few large copies instead of one small copy per token. The decode
rows are gathered into one batch padded to the longest context and masked, so a decode's reduction (and
its last bits) depends on the rest of the batch: the native backend exists for that. Grouped-query
attention copies no K/V for the decode rows or a chunk after cached context: the query heads that share a
KV head are laid along the query-length axis, so one SDPA call serves the whole group.

A sliding-window layer gathers only from the first block its rows' windows reach and masks what the
windows exclude (`window_mask`, built once per step and window: `TorchAttentionMetadata.window_masks`),
so a block wholly before every row's window is never read.

Attention sinks (gpt-oss: a learned logit per head in the softmax's denominator) are computed here in
plain ops (`_attend`, a slice of rows at a time), since SDPA has no such term.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.model import kv_quant
from kvserve.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    ScheduledChunk,
    slot_mapping,
    write_kv,
)


@dataclass
class ContinuedChunk:
    """Tokens [start, end) of the step are a prefill chunk after `context_len` cached positions' worth
    of its sequence: `context_blocks` lists the blocks of all its tokens so far (`context_len` of them
    count) and `mask` [chunk * query heads per KV head, context_len] is the causal mask against them, one
    row per (token, head in group)."""

    start: int
    end: int
    context_blocks: torch.Tensor
    context_len: int
    mask: torch.Tensor


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    """`decode_tables` [decodes, blocks of the longest] and `decode_len` (the longest context) describe
    the decode rows, None and 0 without decodes; `decode_mask` [decodes, 1, 1, decode_len] masks their
    padding, None when every decode has the same context length. `first_chunks` are the [start, end)
    spans of the prefill chunks that start their sequence (they attend to the step's fresh K/V alone);
    `continued_chunks` the others. `decode_positions` are the decodes' positions; `windowed` keeps each
    sliding window's masks, made by the first layer with that window (`window_masks`)."""

    decode_tables: torch.Tensor | None
    decode_len: int
    decode_mask: torch.Tensor | None
    first_chunks: list[tuple[int, int]]
    continued_chunks: list[ContinuedChunk]
    decode_positions: list[int] = field(default_factory=list)
    windowed: dict[int, "WindowMasks"] = field(default_factory=dict)

    def window_masks(self, window: int, group: int, block_size: int, device: torch.device) -> "WindowMasks":
        """The step's masks under `window`, shaped as the unwindowed ones (`decode_mask`, a first
        chunk's causal mask, `ContinuedChunk.mask`) but over the keys from the first block any of their
        rows' windows reaches."""
        if window not in self.windowed:
            positions = torch.tensor(self.decode_positions, dtype=torch.long)
            first = _first_block(min(self.decode_positions, default=0), window, block_size)
            keys = self.decode_len - first * block_size
            decodes = window_mask(positions, keys, window, first * block_size)
            continued = []
            for c in self.continued_chunks:
                start = c.context_len - (c.end - c.start)
                fb = _first_block(start, window, block_size)
                mask = window_mask(
                    torch.arange(start, c.context_len),
                    c.context_len - fb * block_size,
                    window,
                    fb * block_size,
                )
                continued.append((fb, mask.repeat_interleave(group, dim=0).to(device)))
            self.windowed[window] = WindowMasks(
                first,
                decodes.view(len(positions), 1, 1, keys).to(device),
                [
                    window_mask(torch.arange(end - start), end - start, window).to(device)
                    for start, end in self.first_chunks
                ],
                continued,
            )
        return self.windowed[window]


@dataclass
class WindowMasks:
    """One sliding window's masks for one step, over the keys from a first block on (the blocks before
    it are not gathered): the decodes' [decodes, 1, 1, decode_len - decode_block * block_size] from block
    `decode_block`, each first chunk's [n, n], each continued chunk's first block and mask [n * group,
    context_len - first block * block_size]."""

    decode_block: int
    decodes: torch.Tensor
    first_chunks: list[torch.Tensor]
    continued_chunks: list[tuple[int, torch.Tensor]]


def _first_block(position: int, window: int, block_size: int) -> int:
    """The block of the first key that the token at `position` attends to under `window`."""
    return max(0, position - window + 1) // block_size


def window_mask(positions: torch.Tensor, keys: int, window: int | None, offset: int = 0) -> torch.Tensor:
    """[len(positions), keys]: True where the token at each position may attend to the key at position
    offset + k, causally and, with a window, only to keys in [position - window + 1, position]
    (transformers' sliding window)."""
    k = torch.arange(offset, offset + keys).unsqueeze(0)
    p = positions.unsqueeze(1)
    allowed = k <= p
    if window is not None:
        allowed &= k > p - window
    return allowed


def _gather(cache: torch.Tensor, blocks: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Blocks [..., n] of a layer's cache -> [..., n * block_size, kv_heads, head_dim] in `dtype` (a q8_0
    cache's gathered blocks dequantized)."""
    heads, width = cache.shape[1], cache.shape[2]
    paged = cache.view(-1, block_size, heads, width)
    gathered = paged.index_select(0, blocks.reshape(-1)).view(*blocks.shape[:-1], -1, heads, width)
    return kv_quant.values(gathered, dtype)


class TorchAttention(AttentionBackend):
    """The portable backend, for `group` query heads per KV head on `device`."""

    def __init__(self, block_size: int, group: int, device: torch.device) -> None:
        self.block_size = block_size
        self.group = group
        self.device = device

    def prepare(
        self, decodes: Sequence[ScheduledChunk], prefills: Sequence[ScheduledChunk]
    ) -> TorchAttentionMetadata:
        dev, bs = self.device, self.block_size
        decode_tables = decode_mask = None
        decode_len = 0
        if decodes:
            lengths = [c.start + 1 for c in decodes]
            decode_len = max(lengths)
            width = -(-decode_len // bs)
            # Padding points at block 0: it is read but masked out.
            rows = [c.block_table[:width] + [0] * (width - len(c.block_table[:width])) for c in decodes]
            decode_tables = torch.tensor(rows, dtype=torch.long, device=dev)
            if min(lengths) != decode_len:
                valid = torch.arange(decode_len) < torch.tensor(lengths).unsqueeze(1)
                decode_mask = valid.view(len(lengths), 1, 1, decode_len).to(dev)
        first: list[tuple[int, int]] = []
        continued: list[ContinuedChunk] = []
        offset = len(decodes)
        for c in prefills:
            n = len(c.token_ids)
            if c.start == 0:
                first.append((offset, offset + n))
            else:
                total = c.start + n
                blocks = torch.tensor(c.block_table[: -(-total // bs)], dtype=torch.long, device=dev)
                causal = torch.arange(total).unsqueeze(0) <= torch.arange(c.start, total).unsqueeze(1)
                mask = causal.repeat_interleave(self.group, dim=0).to(dev)
                continued.append(ContinuedChunk(offset, offset + n, blocks, total, mask))
            offset += n
        return TorchAttentionMetadata(
            slot_mapping=slot_mapping([*decodes, *prefills], bs, dev),
            num_decodes=len(decodes),
            num_prefills=len(prefills),
            decode_tables=decode_tables,
            decode_len=decode_len,
            decode_mask=decode_mask,
            first_chunks=first,
            continued_chunks=continued,
            decode_positions=[c.start for c in decodes],
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # A sliding layer reads its own group's tables and slots.
        meta = meta.group(window)
        assert isinstance(meta, TorchAttentionMetadata)
        k_stored, v_stored = write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        bs = self.block_size
        masks = None if window is None else meta.window_masks(window, self.group, bs, self.device)
        out = torch.empty_like(q)
        if meta.decode_tables is not None:
            nd = meta.num_decodes
            # A sliding layer gathers only from the first block a decode's window reaches.
            first = 0 if masks is None else masks.decode_block
            tables, keys = meta.decode_tables[:, first:], meta.decode_len - first * bs
            kd = _gather(k_cache, tables, bs, q.dtype)[:, :keys]
            vd = _gather(v_cache, tables, bs, q.dtype)[:, :keys]
            mask = meta.decode_mask if masks is None else masks.decodes
            out[:nd] = _decode_rows(q[:nd], kd, vd, mask, scale, sinks)
        if meta.first_chunks:
            # Only these read the fresh K/V: as the cache holds them, the same values a later chunk reads.
            k_fresh, v_fresh = kv_quant.values(k_stored, q.dtype), kv_quant.values(v_stored, q.dtype)
            for i, (start, end) in enumerate(meta.first_chunks):
                first_mask = None if masks is None else masks.first_chunks[i]
                out[start:end] = _first_chunk(
                    q[start:end], k_fresh[start:end], v_fresh[start:end], scale, first_mask, sinks
                )
        for i, chunk in enumerate(meta.continued_chunks):
            first, mask = (0, chunk.mask) if masks is None else masks.continued_chunks[i]
            blocks, keys = chunk.context_blocks[first:], chunk.context_len - first * bs
            kc = _gather(k_cache, blocks, bs, q.dtype)[:keys]
            vc = _gather(v_cache, blocks, bs, q.dtype)[:keys]
            out[chunk.start : chunk.end] = _continued_chunk(
                q[chunk.start : chunk.end], kc, vc, mask, scale, sinks
            )
        return out


# Bytes of float scores one slice of sink-attention rows takes: bounds a long prefill chunk's memory.
_SINK_SCORES_BYTES = 64 << 20


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None,
    causal: bool = False,
) -> torch.Tensor:
    """SDPA of q [..., L, D] over k/v [..., S, D] under the boolean `mask` (True: attend) or causally;
    with `sinks` (broadcast to [..., L, 1]: each query row's head's sink logit) the softmax's denominator
    also holds exp(sink), as gpt-oss's attention has it: SDPA has no such term, so these rows are
    computed in plain ops, the sink also taking part in the softmax's max, a slice of rows at a time."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    rows, keys = q.shape[-2], k.shape[-2]
    per_row = q[..., :1, :1].numel() * keys * q.element_size()
    step = max(1, _SINK_SCORES_BYTES // max(1, per_row))
    out = torch.empty_like(q)
    for start in range(0, rows, step):
        end = min(rows, start + step)
        scores = torch.matmul(q[..., start:end, :], k.transpose(-1, -2)).mul_(scale)
        part = mask
        if causal:
            part = torch.arange(keys, device=q.device) <= torch.arange(start, end, device=q.device).unsqueeze(
                1
            )
        elif mask is not None and mask.shape[-2] == rows:
            part = mask[..., start:end, :]
        if part is not None:
            scores.masked_fill_(~part, float("-inf"))
        sink = sinks[..., start:end, :] if sinks.shape[-2] == rows else sinks
        top = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
        weights = scores.sub_(top).exp_()
        denominator = weights.sum(dim=-1, keepdim=True).add_((sink - top).exp_())
        out[..., start:end, :] = torch.matmul(weights, v).div_(denominator)
    return out


def _decode_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [decodes, Hq, D] over their gathered, padded contexts k/v [decodes, len, Hkv, D]."""
    rows, heads, dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    qd = q.view(rows, kv_heads, group, dim)
    row_sinks = None if sinks is None else sinks.view(1, kv_heads, group, 1)
    od = _attend(qd, k.transpose(1, 2), v.transpose(1, 2), mask, scale, row_sinks)
    return od.reshape(rows, heads, dim)


def _first_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [n, Hq, D] causally over the chunk's own k/v [n, Hkv, D], or under `mask` [n, n] (a window)."""
    heads = q.shape[1]
    group = heads // k.shape[1]
    # The CPU flash kernel wants contiguous 4-D [1, heads, len, dim] inputs with equal head counts.
    qs = q.transpose(0, 1).unsqueeze(0).contiguous()
    ks = k.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
    vs = v.transpose(0, 1).repeat_interleave(group, dim=0).unsqueeze(0)
    row_sinks = None if sinks is None else sinks.view(1, heads, 1, 1)
    out = _attend(qs, ks, vs, mask, scale, row_sinks, causal=mask is None)
    return out[0].transpose(0, 1)


def _continued_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [n, Hq, D] over the gathered context k/v [context, Hkv, D] under the chunk's causal `mask`."""
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    # As for the decode rows, the queries of a KV group share its keys, laid along the query axis (mask
    # rows follow), so the long context is never copied per query head.
    qs = q.view(n, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(1, kv_heads, -1, dim)
    ks, vs = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    row_sinks = None
    if sinks is not None:
        row_sinks = sinks.view(kv_heads, 1, group).expand(kv_heads, n, group).reshape(1, kv_heads, -1, 1)
    os_ = _attend(qs, ks, vs, mask, scale, row_sinks)
    return os_[0].view(kv_heads, n, group, dim).permute(1, 0, 2, 3).reshape(n, heads, dim)
