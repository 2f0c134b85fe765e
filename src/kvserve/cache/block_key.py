"""Chained block keys: a block's key names its namespace, its whole prefix and the model that made it.

key = sha256(fingerprint, namespace, parent key, the block's token ids), with lengths framing each part,
so two blocks share a key only if they hold the same tokens after the same prefix, in the same
namespace, computed by the same model and settings. The first block's parent is ROOT.

A hybrid model's state checkpoint after P tokens is keyed alike (`state_key`): its parent is the key of
the last full block before P, its tokens the 0 to block_size - 1 tokens after it, and the state's
layout (a digest of its tensors' shapes and dtypes) is framed in after a tag no block key begins with.
"""

import hashlib
import struct
from collections.abc import Sequence

ROOT = bytes(32)


STATE_TAG = b"kvserve state checkpoint"


def chain_key(fingerprint: bytes, namespace: str, parent: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.sha256()
    ns = namespace.encode()
    h.update(struct.pack("<II", len(fingerprint), len(ns)))
    h.update(fingerprint)
    h.update(ns)
    h.update(parent)
    h.update(struct.pack(f"<I{len(tokens)}q", len(tokens), *tokens))
    return h.digest()


def state_key(
    fingerprint: bytes, layout: bytes, namespace: str, parent: bytes, tokens: Sequence[int]
) -> bytes:
    return StateKeys(fingerprint, layout, namespace).key(parent, tokens)


class StateKeys:
    """`state_key` for one model, state layout and namespace: what they share is hashed once, so that
    an admission's thousands of candidate positions cost a copy and two updates each."""

    def __init__(self, fingerprint: bytes, layout: bytes, namespace: str) -> None:
        h = hashlib.sha256()
        h.update(struct.pack("<II", len(STATE_TAG), len(layout)))
        h.update(STATE_TAG)
        h.update(layout)
        ns = namespace.encode()
        h.update(struct.pack("<II", len(fingerprint), len(ns)))
        h.update(fingerprint)
        h.update(ns)
        self._base = h

    def key(self, parent: bytes, tokens: Sequence[int]) -> bytes:
        h = self._base.copy()
        h.update(parent)
        h.update(struct.pack(f"<I{len(tokens)}q", len(tokens), *tokens))
        return h.digest()


def record_key(
    fingerprint: bytes, namespace: str, parent: bytes, tokens: Sequence[int], layout: bytes | None
) -> bytes:
    """A stored value's key: a block's (`layout` None) or a state checkpoint's of that layout."""
    if layout is None:
        return chain_key(fingerprint, namespace, parent, tokens)
    return state_key(fingerprint, layout, namespace, parent, tokens)
