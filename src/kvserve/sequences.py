"""The length of the common prefix of two sequences: token lists (the prefix tree, the scheduler, the
prompt-cache markers) and rendered chats (the miss report's parts)."""

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def common_prefix_len(a: Sequence[T], b: Sequence[T], limit: int | None = None) -> int:
    """How many leading items `a` and `b` share, at most `limit`. By halves, each a slice compared in C:
    a chat's render or a long prompt is compared in a few passes rather than item by item in Python.
    A tuple and a list (a tree node's tokens and a prompt's) are compared as tuples: their slices never
    compare equal otherwise."""
    if type(a) is not type(b):
        a, b = tuple(a), tuple(b)
    n = min(len(a), len(b), len(a) if limit is None else limit)
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
