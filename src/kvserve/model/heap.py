"""Hands the C heap's free memory back to the system once a model is built.

Loading reads every weight several times over (the file's tensors, their blocks, the fingerprint's float
rows) and frees it again; glibc keeps such freed memory in its heap, resident, for later allocations
that a serving process never makes. `malloc_trim` returns it. Elsewhere than glibc this does nothing.
"""

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
        lib.malloc_trim.argtypes = [ctypes.c_size_t]
        lib.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return lib


def release_free_heap() -> bool:
    """Returns the heap's free pages to the system; whether any were (False off glibc)."""
    lib = _libc()
    return bool(lib is not None and lib.malloc_trim(0))
