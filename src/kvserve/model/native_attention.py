"""The native attention backend: the paged-attention kernel (kernels/paged_attention.c), built on first
use and called via ctypes, for decode rows and prefill rows alike.

Why native code: torch has no paged attention on the CPU, so the portable path gathers every decode's
context into a padded copy each step and runs SDPA over it. The kernel reads each row's KV blocks in
place, does not pad short rows to the longest one, and reduces in an order that depends on the row alone,
which makes a row's output bitwise independent of the rest of the batch (see the kernel's header). A
prefill token is one of its rows too, exactly as that token's decode would be: a token's attention has
the same bits whether its step was a prefill or a decode.

The library is built and loaded by kvserve.model.native_build, its symbols and flags declared in
kvserve.model.kernel_abi (`ATTENTION`).
"""

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

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
from kvserve.model.kernel_abi import ATTENTION, ATTENTION_SYMBOLS
from kvserve.model.native_build import KernelUnavailableError, load_kernel

__all__ = ["KernelUnavailableError", "NativeAttention", "PagedAttentionKernel", "load_library"]


def load_library(cache_dir: str) -> ctypes.CDLL:
    """The compiled kernel library, building it first when these sources and this machine have none."""
    return load_kernel(ATTENTION, cache_dir)


@dataclass(frozen=True)
class PagedAttentionKernel:
    """The native kernel's rows over the paged cache on the CPU, for one compute dtype and one KV cache
    dtype (the same, float16 under float32, or uint8: q8_0 blocks under float32 or float64): each row
    attends to the first `lens[r]` positions of its own table, or with a window to the last `window` of
    them (blocks wholly before those are never read)."""

    lib: ctypes.CDLL
    dtype: torch.dtype
    kv_dtype: torch.dtype

    @classmethod
    def load(
        cls, cache_dir: str, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
    ) -> "PagedAttentionKernel":
        kv = dtype if kv_dtype is None else kv_dtype
        if device.type != "cpu":
            raise KernelUnavailableError(f"the native kernel runs on the CPU, not {device}")
        if (dtype, kv) not in ATTENTION_SYMBOLS:
            raise KernelUnavailableError(
                "the native kernel supports float32 and float64, a float16 cache under float32 and a "
                f"q8_0 cache under either, not {dtype} with a {kv} cache"
            )
        lib = load_library(cache_dir)
        if getattr(lib, ATTENTION_SYMBOLS[dtype, kv], None) is None:
            raise KernelUnavailableError("this C compiler has no _Float16: no float16-cache kernel")
        return cls(lib, dtype, kv)

    @property
    def address(self) -> int:
        """The kernel's function address, for native callers (the decoder layers)."""
        address = ctypes.cast(
            getattr(self.lib, ATTENTION_SYMBOLS[self.dtype, self.kv_dtype]), ctypes.c_void_p
        ).value
        assert address is not None
        return address

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        block_size: int,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [rows, heads, dim] (rows may be strided); caches [slots, kv_heads, dim]; tables [rows, width]
        (rows may be strided, or all one table: a prefill chunk's tokens share their sequence's) and lens
        [rows] int64; `window`: None (every position) or a sliding window of at least 1; `sinks`: None or
        each head's sink logit [heads] (float32). Returns [rows, heads, dim]."""
        assert window is None or window >= 1
        rows, heads, dim = q.shape
        # The kernel indexes heads and dims densely within a row and the caches and tables fully.
        assert q.stride(2) == 1 and q.stride(1) == dim and q.dtype == self.dtype
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == self.kv_dtype
        quantized = self.kv_dtype == kv_quant.STORAGE
        assert k_cache.shape[2] == (kv_quant.row_width(kv_quant.Q8_0, dim) if quantized else dim)
        assert tables.stride(1) == 1 and lens.is_contiguous()
        assert tables.dtype == torch.int64 and lens.dtype == torch.int64
        out = torch.empty((rows, heads, dim), dtype=q.dtype)
        status = getattr(self.lib, ATTENTION_SYMBOLS[self.dtype, self.kv_dtype])(
            q.data_ptr(),
            q.stride(0),
            out.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            lens.data_ptr(),
            window or 0,
            rows,
            heads,
            k_cache.shape[1],
            dim,
            block_size,
            scale,
            None if sinks is None else sinks.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("the native attention kernel could not allocate its scratch memory")
        return out


@dataclass
class KernelRows:
    """Tokens [start, end) of the step as kernel rows: row r attends to the first `lens[r]` positions of
    `tables[r]` (tables [rows, width], or one table expanded with a row stride of 0)."""

    start: int
    end: int
    tables: torch.Tensor
    lens: torch.Tensor


@dataclass
class NativeAttentionMetadata(AttentionMetadata):
    """`decode_rows`: the decodes' rows (None without decodes), each its own table cut to the longest
    decode's blocks and its context length; `chunk_rows`: one entry per prefill chunk, every token one row
    of its sequence's one table with its own position + 1 as its length, exactly as that token's decode
    would be."""

    decode_rows: KernelRows | None
    chunk_rows: list[KernelRows]

    def step_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token of the step as one kernel row, decodes then chunks: tables [tokens, width]
        (contiguous, each padded with block 0 to the widest: the kernel never reads past a row's length)
        and lens [tokens]."""
        groups = ([self.decode_rows] if self.decode_rows is not None else []) + self.chunk_rows
        if len(groups) == 1 and groups[0].tables.is_contiguous():
            return groups[0].tables, groups[0].lens
        width = max(g.tables.shape[1] for g in groups)
        tables = torch.cat([F.pad(g.tables, (0, width - g.tables.shape[1])) for g in groups])
        return tables, torch.cat([g.lens for g in groups])


class NativeAttention(AttentionBackend):
    """The native backend: every token of the step is a row of `kernel`, decodes and prefill chunks
    alike. CPU only."""

    def __init__(self, kernel: PagedAttentionKernel, block_size: int) -> None:
        self.kernel = kernel
        self.block_size = block_size

    def prepare(
        self, decodes: Sequence[ScheduledChunk], prefills: Sequence[ScheduledChunk]
    ) -> NativeAttentionMetadata:
        bs = self.block_size
        decode_rows = None
        if decodes:
            lengths = [c.start + 1 for c in decodes]
            width = -(-max(lengths) // bs)
            # Padding points at block 0: the kernel never reads past a row's length.
            tables = [c.block_table[:width] + [0] * (width - len(c.block_table[:width])) for c in decodes]
            decode_rows = KernelRows(
                0,
                len(decodes),
                torch.tensor(tables, dtype=torch.long),
                torch.tensor(lengths, dtype=torch.long),
            )
        chunk_rows: list[KernelRows] = []
        offset = len(decodes)
        for c in prefills:
            n = len(c.token_ids)
            total = c.start + n
            table = torch.tensor(c.block_table[: -(-total // bs)], dtype=torch.long).expand(n, -1)
            lens = torch.arange(c.start + 1, total + 1, dtype=torch.long)
            chunk_rows.append(KernelRows(offset, offset + n, table, lens))
            offset += n
        return NativeAttentionMetadata(
            slot_mapping=slot_mapping([*decodes, *prefills], bs, torch.device("cpu")),
            num_decodes=len(decodes),
            num_prefills=len(prefills),
            decode_rows=decode_rows,
            chunk_rows=chunk_rows,
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
        if sinks is not None:
            # The kernel reads the heads' sinks as float32, whatever the rows' dtype.
            sinks = sinks.to(torch.float32).contiguous()
        # A sliding layer reads its own group's tables and slots.
        meta = meta.group(window)
        assert isinstance(meta, NativeAttentionMetadata)
        # Every row reads its context, its own token's K/V included, from the cache.
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        groups = [meta.decode_rows] if meta.decode_rows is not None else []
        for rows in groups + meta.chunk_rows:
            out[rows.start : rows.end] = self.kernel(
                q[rows.start : rows.end],
                k_cache,
                v_cache,
                rows.tables,
                rows.lens,
                self.block_size,
                scale,
                window,
                sinks,
            )
        return out
