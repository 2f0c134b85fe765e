"""Huge pages for the KV pool (kvserve.model.huge_pages)."""

import ctypes
import mmap
import re
from pathlib import Path

import pytest
import torch

from kvserve.model import huge_pages
from kvserve.model.attention import KVCache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        found = re.search(r"\[(\w+)\]", THP.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def _huge_kib(tensor: torch.Tensor) -> int:
    """AnonHugePages summed over the mappings that hold `tensor` (madvise splits a mapping at the advised
    span), from /proc/self/smaps."""
    start = tensor.data_ptr()
    return _huge_kib_at(start, start + tensor.numel() * tensor.element_size())


def _rss_kib(tensor: torch.Tensor) -> int:
    start = tensor.data_ptr()
    return _huge_kib_at(start, start + tensor.numel() * tensor.element_size(), "Rss:")


def _require_free_huge_pages() -> None:
    """Skip when the kernel gives no huge page to a plain anonymous mapping either, advised and touched:
    its memory is then too fragmented (or short) now, which says nothing of kvserve's buffers."""
    size = 16 << 20
    plain = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        plain.madvise(mmap.MADV_HUGEPAGE)
        plain.write(b"\1" * size)
        start = ctypes.addressof(ctypes.c_char.from_buffer(plain))
        got = _huge_kib_at(start, start + size)
    finally:
        plain.close()
    if got < 2048:
        pytest.skip("the kernel has no free huge page now, not even for a plain mapping")


def _huge_kib_at(start: int, end: int, field: str = "AnonHugePages:") -> int:
    inside, total = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span.group(1), 16) < end and start < int(span.group(2), 16)
        elif inside and line.startswith(field):
            total += int(line.split()[1])
    return total


def test_zeros_is_a_zeroed_tensor_of_the_shape_and_dtype() -> None:
    for shape in ((3, 5), (64, 1 << 16)):
        t = huge_pages.zeros(shape, torch.float16)
        assert t.shape == shape and t.dtype == torch.float16 and t.is_contiguous() and not t.any()


def test_a_large_pool_is_resident_only_where_written() -> None:
    # Zeroing by writing would make the whole worst-case pool resident (and take seconds) at start-up.
    cache = KVCache(2, 8192, 16, 3, 64, torch.device("cpu"), torch.float16)
    assert _rss_kib(cache.k) < 4096
    cache.k[0, :16].fill_(1)
    assert 0 < _rss_kib(cache.k) < 8192


def test_a_buffer_below_one_huge_page_is_left_alone() -> None:
    assert not huge_pages.advise(torch.empty(1000))


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="no transparent huge pages here")
def test_a_large_buffer_gets_huge_pages_once_touched() -> None:
    # Above glibc's largest mmap threshold (32 MiB), so the memory is fresh, never touched before.
    t = huge_pages.zeros((64 << 20,), torch.uint8)
    assert huge_pages.advise(t)
    t.fill_(1)
    if _huge_kib(t) < 2048:
        _require_free_huge_pages()
    assert _huge_kib(t) >= 2048


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="no transparent huge pages here")
def test_the_kv_pool_fills_on_huge_pages() -> None:
    # 48 MiB a cache, above glibc's largest mmap threshold (32 MiB) like any real pool: a smaller one can
    # come from memory the heap has touched before (which earlier tests in the run leave), on small pages.
    cache = KVCache(2, 8192, 16, 3, 64, torch.device("cpu"), torch.float16)
    assert not cache.k.any() and not cache.v.any()
    cache.k.fill_(1)
    cache.v.fill_(1)
    if min(_huge_kib(cache.k), _huge_kib(cache.v)) < 2048:
        _require_free_huge_pages()
    assert _huge_kib(cache.k) >= 2048 and _huge_kib(cache.v) >= 2048
