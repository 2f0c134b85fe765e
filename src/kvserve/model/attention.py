"""Paged attention behind one interface: the KV cache, the step's chunks and the backend contract.

The KV cache (in the compute dtype, or float16 under float32) is one tensor per layer and per K/V, of
shape [num_blocks * block_size, kv_heads, head_dim] (slot = block * block_size + offset). A step's tokens
are laid out decodes first, then one span per prefill chunk.

A backend turns the step's chunks into its own metadata once per step (`prepare`), shared by every
layer, and then, per layer, writes the step's K/V into their slots and attends (`forward`). Two exist:
`TorchAttention` (kvserve.model.torch_attention: portable torch ops, any device) and `NativeAttention`
(kvserve.model.native_attention: the C kernel, bitwise batch-invariant, where a prefill token is the same
row as its decode would be). The choice is made once, when the runner is built.
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.model import huge_pages


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
    the caches hold them (rounded to a lower-precision cache's dtype, or k and v themselves)."""
    k_stored, v_stored = k.to(k_cache.dtype), v.to(v_cache.dtype)
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
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for this step; k_cache/v_cache [slots, Hkv, D] of one layer;
        `window` the layer's sliding window (None: global): a token at position p attends to the keys at
        positions [p - window + 1, p] only, transformers' convention, and nothing before them is read.

        Returns the attention output [T, Hq, D]."""
