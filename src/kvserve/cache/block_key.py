"""Chained block keys: a block's key names its namespace, its whole prefix and the model that made it.

key = sha256(fingerprint, namespace, parent key, the block's token ids), with lengths framing each part,
so two blocks share a key only if they hold the same tokens after the same prefix, in the same
namespace, computed by the same model and settings. The first block's parent is ROOT.
"""

import hashlib
import struct
from collections.abc import Sequence

ROOT = bytes(32)


def chain_key(fingerprint: bytes, namespace: str, parent: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.sha256()
    ns = namespace.encode()
    h.update(struct.pack("<II", len(fingerprint), len(ns)))
    h.update(fingerprint)
    h.update(ns)
    h.update(parent)
    h.update(struct.pack(f"<I{len(tokens)}q", len(tokens), *tokens))
    return h.digest()
