"""The MAC of a stored block: HMAC-SHA256, under a key derived from the server secret, over the block's
key and every stored byte.

A tier below memory keeps blocks where others may write (a disk, a shared store). A checksum only
catches accidents: whoever can write a file can recompute it. A MAC needs the key, so a block that
verifies was written by a holder of the secret, for this very block key (which binds the model, the
namespace, the whole prefix and the block's tokens); a valid block copied under another key fails.
"""

import hashlib
import hmac
from collections.abc import Iterable

MAC_BYTES = 32


class BadMAC(Exception):
    """The stored bytes were not written for this block key by a holder of the key."""


def seal(mac_key: bytes, block_key: bytes, parts: Iterable[bytes | memoryview]) -> bytes:
    """The trailer to store after `parts`: the MAC of the block key and of `parts` in order."""
    h = hmac.new(mac_key, block_key, hashlib.sha256)
    for part in parts:
        h.update(part)
    return h.digest()


def unseal(mac_key: bytes, block_key: bytes, stored: memoryview) -> memoryview:
    """`stored` without its trailer, once the trailer is checked (in constant time); else BadMAC."""
    if len(stored) < MAC_BYTES:
        raise BadMAC("too short to hold a MAC")
    body, trailer = stored[:-MAC_BYTES], stored[-MAC_BYTES:]
    if not hmac.compare_digest(seal(mac_key, block_key, [body]), trailer):
        raise BadMAC("MAC mismatch: not written by this server for this block, or changed since")
    return body
