"""Back the large CPU buffers the kernels stream (the KV pool, the weight blocks) with 2 MiB pages.

A decode reads the KV pool's blocks wherever they sit in hundreds of MiB, a few KiB per block and KV head,
and the weights as one stream of about 100 MB per token: with 4 KiB pages nearly every block costs a TLB
miss. Linux's transparent huge pages are commonly enabled only for memory that asks (`madvise` mode), so
`zeros` asks before the first touch, which is when the kernel chooses the page size (docs/benchmarks.md
has what it gains). Elsewhere (no Linux, no huge pages, another device) the buffers are
plain ones.
"""

import ctypes
import ctypes.util
import functools
import math
import mmap
import sys
from collections.abc import Callable

import torch

_HUGE = 2 << 20
# Linux's MADV_HUGEPAGE.
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def advise(tensor: torch.Tensor) -> bool:
    """Ask for huge pages over the 2 MiB-aligned spans of `tensor`'s memory; pages already touched keep
    their size. Returns whether the kernel took the advice (False for small or non-CPU tensors)."""
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // _HUGE) * _HUGE
    last = end // _HUGE * _HUGE
    return last > first and madvise(first, last - first, _MADV_HUGEPAGE) == 0


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """`torch.zeros`, with huge pages asked for before anything touches the memory. A CPU buffer of a
    huge page or more is a private anonymous mapping of its own, advised before the tensor exists (memory
    from the allocator may have been touched before, and touched pages keep their size). Its fresh pages
    read as zeros without being written, so they are committed only as they are first written: a pool
    sized for the worst case costs neither the start-up time of zeroing it nor its resident memory until
    it fills (docs/benchmarks.md, Resident memory)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < _HUGE or _madvise() is None:
        tensor = torch.empty(shape, dtype=dtype, device=device)
        advise(tensor)
        return tensor.zero_()
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE)
    # The tensor holds the mapping: it is unmapped when the last view of it goes.
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)
