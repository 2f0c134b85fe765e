"""Hands memory back to the system that a serving process holds but does not use.

Loading reads every weight several times over (the file's tensors, their blocks, the fingerprint's float
rows) and frees it again, and each burst of steps frees its activations; glibc keeps such freed memory
in its heap, resident, and `malloc_trim` returns it (`release_free_heap`). Starting up runs code and reads
constants of the libraries (torch's operator registrations above all) that serving never runs again;
`release_startup_pages` lets those file pages go. Elsewhere than glibc on Linux both do nothing.
"""

import ctypes
import ctypes.util
import functools
import re

MADV_DONTNEED = 4

# A mapping's first line in /proc/PID/smaps: its range, permissions, offset, device, inode and path.
_MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \S+\s*(.*)$")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
        lib.malloc_trim.argtypes = [ctypes.c_size_t]
        lib.malloc_trim.restype = ctypes.c_int
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return lib


def release_free_heap() -> bool:
    """Returns the heap's free pages to the system; whether any were (False off glibc)."""
    lib = _libc()
    return bool(lib is not None and lib.malloc_trim(0))


def clean_file_mappings(smaps: str) -> list[tuple[int, int]]:
    """The (start, end) of the private read-only file mappings in `smaps` (/proc/PID/smaps' text) none
    of whose pages the process has written: every resident page of theirs is the file's own."""
    found: list[tuple[int, int]] = []
    current: tuple[int, int] | None = None
    for line in smaps.splitlines():
        header = _MAPPING.match(line)
        if header is not None:
            start, end, perms, path = header.groups()
            readable_only = perms in ("r--p", "r-xp")
            current = (int(start, 16), int(end, 16)) if readable_only and path.startswith("/") else None
        elif current is not None and line.startswith("Anonymous:"):
            # Written pages (relocations before the loader made them read-only) are the process's
            # own copies: dropping them would lose them, so such a mapping stays whole.
            if int(line.split()[1]) == 0:
                found.append(current)
            current = None
    return found


def release_startup_pages() -> int:
    """Drops the clean file pages of read-only mappings (libraries' code and constants) from this
    process's resident set; returns how many mappings it did. A page touched again is mapped again
    from the page cache, exactly as after the kernel reclaimed it under memory pressure, so this is
    for once startup is done: what serving runs comes back and stays, what only startup ran stays out."""
    lib = _libc()
    if lib is None:
        return 0
    try:
        with open("/proc/self/smaps") as f:
            smaps = f.read()
    except OSError:
        return 0
    mappings = clean_file_mappings(smaps)
    return sum(lib.madvise(start, end - start, MADV_DONTNEED) == 0 for start, end in mappings)
