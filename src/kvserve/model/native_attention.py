"""The native attention kernel (kernels/paged_attention.c): built on first use, called via ctypes.

Why native code: torch has no paged attention on the CPU, so the portable path gathers every decode's
context into a padded copy each step and runs SDPA over it. The kernel reads each row's KV blocks in
place, does not pad short rows to the longest one, and reduces in position order within one thread,
which makes a decode's output bitwise independent of the rest of the batch (see the kernel's header).

The library is built and loaded by kvserve.model.native_build, its symbols and flags declared in
kvserve.model.kernel_abi (`ATTENTION`).
"""

import ctypes
from dataclasses import dataclass

import torch

from kvserve.model.kernel_abi import ATTENTION
from kvserve.model.kernel_abi import ATTENTION_SYMBOLS as _SYMBOLS
from kvserve.model.native_build import KernelUnavailableError, load_kernel

__all__ = ["KernelUnavailableError", "NativeDecodeAttention", "load_library"]


def load_library(cache_dir: str) -> ctypes.CDLL:
    """The compiled kernel library, building it first when these sources and this machine have none."""
    return load_kernel(ATTENTION, cache_dir)


@dataclass(frozen=True)
class NativeDecodeAttention:
    """Decode attention over the paged cache through the native kernel on the CPU, for one compute dtype
    and one KV cache dtype (the same, or float16 under float32)."""

    lib: ctypes.CDLL
    dtype: torch.dtype
    kv_dtype: torch.dtype

    @classmethod
    def load(
        cls, cache_dir: str, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
    ) -> "NativeDecodeAttention":
        kv = dtype if kv_dtype is None else kv_dtype
        if device.type != "cpu":
            raise KernelUnavailableError(f"the native kernel runs on the CPU, not {device}")
        if (dtype, kv) not in _SYMBOLS:
            raise KernelUnavailableError(
                "the native kernel supports float32 and float64, and a float16 cache under float32, "
                f"not {dtype} with a {kv} cache"
            )
        lib = load_library(cache_dir)
        if getattr(lib, _SYMBOLS[dtype, kv], None) is None:
            raise KernelUnavailableError("this C compiler has no _Float16: no float16-cache kernel")
        return cls(lib, dtype, kv)

    @property
    def address(self) -> int:
        """The kernel's function address, for native callers (the decoder layers)."""
        address = ctypes.cast(getattr(self.lib, _SYMBOLS[self.dtype, self.kv_dtype]), ctypes.c_void_p).value
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
    ) -> torch.Tensor:
        """q [rows, heads, dim] (rows may be strided); caches [slots, kv_heads, dim]; tables [rows, width]
        (rows may be strided, or all one table: a prefill chunk's tokens share their sequence's) and lens
        [rows] int64. Returns [rows, heads, dim]."""
        rows, heads, dim = q.shape
        # The kernel indexes heads and dims densely within a row and the caches and tables fully.
        assert q.stride(2) == 1 and q.stride(1) == dim and q.dtype == self.dtype
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == self.kv_dtype
        assert tables.stride(1) == 1 and lens.is_contiguous()
        assert tables.dtype == torch.int64 and lens.dtype == torch.int64
        out = torch.empty((rows, heads, dim), dtype=q.dtype)
        status = getattr(self.lib, _SYMBOLS[self.dtype, self.kv_dtype])(
            q.data_ptr(),
            q.stride(0),
            out.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tables.data_ptr(),
            tables.stride(0),
            lens.data_ptr(),
            rows,
            heads,
            k_cache.shape[1],
            dim,
            block_size,
            scale,
            torch.get_num_threads(),
        )
        if status != 0:
            raise MemoryError("the native attention kernel could not allocate its scratch memory")
        return out
