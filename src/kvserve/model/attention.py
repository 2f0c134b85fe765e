"""Paged attention behind one interface: the KV cache, the step's chunks and the backend contract.

The KV cache (in the compute dtype, float16 under float32, or q8_0 blocks: kvserve.model.kv_quant) is
one tensor per layer and per K/V, of shape [num_blocks * block_size, kv_heads, head_dim] (q8_0: head_dim
/ 32 * 34 bytes; slot = block * block_size + offset), in two groups
(global and sliding layers) with block ids of their own. A step's tokens
are laid out decodes first, then one span per prefill chunk.

A backend turns the step's chunks into its own metadata once per step (`prepare`), shared by every
layer, and then, per layer, writes the step's K/V into their slots and attends (`forward`). Two exist:
`TorchAttention` (kvserve.model.torch_attention: portable torch ops, any device) and `NativeAttention`
(kvserve.model.native_attention: the C kernel, bitwise batch-invariant, where a prefill token is the same
row as its decode would be). The choice is made once, when the runner is built.
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvserve.model import huge_pages, kv_quant


class KVCache:
    """Preallocated paged K/V memory for every layer, in two groups by the layer's attention window.

    The global layers (no window) form one group and the sliding layers another, each one K and one V
    tensor [layers in group, blocks * block_size, kv_heads, head_dim] with its own block ids: a sliding
    layer's block may be released once it lies wholly before every window while the global layers' block
    of the same positions stays. A model without sliding layers has the global group alone (`k`, `v`),
    exactly one tensor per K/V over every layer.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
        windows: Sequence[int | None] = (),
        num_sliding_blocks: int | None = None,
    ) -> None:
        """`windows[i]` is layer i's window (empty: every layer global); the sliding group holds
        `num_sliding_blocks` blocks (default `num_blocks`: one id space shared with the global group)."""
        self.block_size = block_size
        self.dtype = dtype
        windows = list(windows) or [None] * num_layers
        # Each layer's group (False: global, True: sliding) and its index within that group.
        self._group: list[tuple[bool, int]] = []
        counts = [0, 0]
        for w in windows:
            self._group.append((w is not None, counts[w is not None]))
            counts[w is not None] += 1
        self.num_sliding_layers = counts[1]
        self.num_sliding_blocks = num_blocks if num_sliding_blocks is None else num_sliding_blocks
        # With one id space a block id names both groups' block of the same positions.
        self.shared_ids = bool(counts[1]) and num_sliding_blocks is None
        shape = (counts[0], num_blocks * block_size, num_kv_heads, head_dim)
        self.k = huge_pages.zeros(shape, dtype, device)
        self.v = huge_pages.zeros(shape, dtype, device)
        sliding = (counts[1], self.num_sliding_blocks * block_size, num_kv_heads, head_dim)
        self.sliding_k = huge_pages.zeros(sliding, dtype, device) if counts[1] else self.k[:0]
        self.sliding_v = huge_pages.zeros(sliding, dtype, device) if counts[1] else self.v[:0]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's K and V caches [slots, kv_heads, head_dim], in its group's slots."""
        sliding, j = self._group[i]
        return (self.sliding_k[j], self.sliding_v[j]) if sliding else (self.k[j], self.v[j])

    def copy_block(self, src: int, dst: int, sliding: bool = False) -> None:
        """Copy block `src` onto `dst` in the global group (and the sliding one when they share ids), or
        in the sliding group alone with `sliding`."""
        if self.shared_ids and not sliding:
            self.copy_block(src, dst, sliding=True)
        bs = self.block_size
        k, v = (self.sliding_k, self.sliding_v) if sliding else (self.k, self.v)
        k[:, dst * bs : (dst + 1) * bs] = k[:, src * bs : (src + 1) * bs]
        v[:, dst * bs : (dst + 1) * bs] = v[:, src * bs : (src + 1) * bs]

    def read_block(self, block: int, sliding_block: int | None = None) -> torch.Tensor:
        """A CPU copy of one block's K and V in every layer, [2, layers, block_size, kv_heads, head_dim],
        from global block `block` and sliding block `sliding_block` (where the sliding group's ids are
        its own; with one id space `block` serves both).

        The copy's layout is the exchange format of the cache tiers, whatever the cache's own layout, so
        that a block written by one layout reads back under another.
        """
        bs = self.block_size
        rows = slice(block * bs, (block + 1) * bs)
        if not self.num_sliding_layers:
            return torch.stack((self.k[:, rows], self.v[:, rows])).to("cpu", copy=True)
        s = block if self.shared_ids else sliding_block
        if s is None:
            raise ValueError("the sliding layers have ids of their own: name the block's sliding block")
        srows = slice(s * bs, (s + 1) * bs)
        layers = [
            torch.stack((self.sliding_k[j, srows], self.sliding_v[j, srows]))
            if sliding
            else torch.stack((self.k[j, rows], self.v[j, rows]))
            for sliding, j in self._group
        ]
        return torch.stack(layers, dim=1).to("cpu", copy=True)

    def write_block(self, block: int, data: torch.Tensor, sliding_block: int | None = None) -> None:
        """Overwrite one block's K and V with `data` as `read_block` returns it. Where the sliding group's
        ids are its own, its layers are written to `sliding_block`, and not at all when that is None
        (a block whose sliding part is not kept)."""
        bs = self.block_size
        rows = slice(block * bs, (block + 1) * bs)
        if not self.num_sliding_layers:
            self.k[:, rows] = data[0].to(self.k.device)
            self.v[:, rows] = data[1].to(self.v.device)
            return
        s = block if self.shared_ids else sliding_block
        srows = slice(s * bs, (s + 1) * bs) if s is not None else None
        for i, (sliding, j) in enumerate(self._group):
            if sliding and srows is None:
                continue
            k, v, r = (self.sliding_k, self.sliding_v, srows) if sliding else (self.k, self.v, rows)
            k[j, r] = data[0, i].to(k.device)
            v[j, r] = data[1, i].to(v.device)

    def block_shape(self) -> tuple[int, ...]:
        """The shape of `read_block`'s result."""
        return (2, len(self._group), self.block_size, self.k.shape[2], self.k.shape[3])


class ScheduledChunk(Protocol):
    """What attention reads of one request's tokens in a step: they sit at positions start, start+1, ...,
    and `block_table` covers every position up to start + len(token_ids)."""

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def start(self) -> int: ...

    @property
    def block_table(self) -> list[int]: ...


@dataclass
class AttentionMetadata:
    """What every layer's attention reads of one step, built once by the step's backend.

    `slot_mapping` [tokens] is each token's cache slot, in the step's order (decodes, then the prefill
    chunks' tokens); the step holds `num_decodes` decodes and `num_prefills` prefill chunks.
    """

    slot_mapping: torch.Tensor
    num_decodes: int
    num_prefills: int
    # The same step over the sliding layers' block tables (their own ids), for the layers with a
    # window; None when the model has no sliding group or its ids are the global ones.
    sliding: "AttentionMetadata | None" = field(default=None, kw_only=True)

    def group(self, window: int | None) -> "AttentionMetadata":
        """The metadata a layer with `window` reads: its group's tables and slots."""
        return self.sliding if window is not None and self.sliding is not None else self


def slot_mapping(chunks: Sequence[ScheduledChunk], block_size: int, device: torch.device) -> torch.Tensor:
    """Each token's cache slot, chunk after chunk."""
    slots = [
        c.block_table[p // block_size] * block_size + p % block_size
        for c in chunks
        for p in range(c.start, c.start + len(c.token_ids))
    ]
    return torch.tensor(slots, dtype=torch.long, device=device)


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the step's k/v [tokens, kv_heads, dim] into `slots` of one layer's caches; returns them as
    the caches hold them (rounded to a lower-precision cache's dtype, q8_0 blocks for a uint8 cache, or
    k and v themselves: `kv_quant.values` reads them back)."""
    k_stored, v_stored = kv_quant.store(k, k_cache.dtype), kv_quant.store(v, v_cache.dtype)
    k_cache.index_copy_(0, slots, k_stored)
    v_cache.index_copy_(0, slots, v_stored)
    return k_stored, v_stored


class AttentionBackend(ABC):
    """One way to run paged attention: its own metadata per step, then every layer's attention.

    Invariants every backend keeps: `forward` writes the step's K/V into `meta.slot_mapping` before it
    attends, so each token attends to its own K/V as the cache holds them (a lower-precision cache's
    rounded values, whether its context was just computed or cached); `forward` takes only the metadata
    of this backend's own `prepare`.
    """

    block_size: int

    @abstractmethod
    def prepare(
        self, decodes: Sequence[ScheduledChunk], prefills: Sequence[ScheduledChunk]
    ) -> AttentionMetadata:
        """The metadata of a step of `decodes` (one token each) and then `prefills` (chunks), in that
        order."""

    @abstractmethod
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
        """q [T, Hq, D], k/v [T, Hkv, D] for this step; k_cache/v_cache [slots, Hkv, D] of one layer;
        `window` the layer's sliding window (None: global): a token at position p attends to the keys at
        positions [p - window + 1, p] only, transformers' convention, and nothing before them is read.
        `sinks` [Hq]: each head's sink logit, which joins the softmax's max and denominator and attends
        to nothing (gpt-oss); None: no sinks.

        Returns the attention output [T, Hq, D]."""
