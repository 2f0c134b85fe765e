"""Sealing a stored block: AES-256-GCM under a key derived from the server secret, so that the stored
bytes can be neither read nor changed by anyone without it.

A tier below memory keeps blocks where others may read and write (a disk folder, a shared Redis). The
KV itself gives the prompt back to whoever has the model (layer 0's V depends on the token alone), so a
MAC, which stops forgery, is not enough: the payload is encrypted. A sealed value is

    header | nonce (12 bytes, random, fresh for each value) | ciphertext of the payload | tag (16 bytes)

where the header is the tier's own (format version, dtype, shape) and stays in clear: a loader compares
it byte for byte with the one it would write before anything else. The associated data is the value's
name (the disk tier's chain key, the Redis key name) and the header, so a value copied under another
name, or with an edited header, does not open. A value opens only under the key that sealed it, for
that name and header, unchanged; it then was written by a holder of the secret for that very block
(the name binds the model, the namespace, the whole prefix and the block's tokens).

Random 96-bit nonces under one key stay safe for about 2**32 values (the chance of a repeated nonce
stays below 2**-32); a server writes a few hundred blocks a second at most, so that is decades.
"""

import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

Bytes = bytes | bytearray | memoryview

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
# What sealing adds to a header and payload.
OVERHEAD = NONCE_BYTES + TAG_BYTES


class Unsealable(Exception):
    """Stored bytes that were not sealed under this key for this name and header, or changed since."""


def sealed_size(header: bytes, payload_bytes: int) -> int:
    """The size of every sealed value with this header and a payload of this size: known before a
    byte of it is read."""
    return len(header) + OVERHEAD + payload_bytes


def _associated_data(name: bytes, header: bytes) -> bytes:
    # The name's length first, so that no other split of the same bytes into name and header matches.
    return len(name).to_bytes(4, "little") + name + header


class BlockSeal:
    """Seals and opens the values of one tier under one key (derive it with secret.derive_key and the
    tier's own purpose)."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a sealing key has {KEY_BYTES} bytes, not {len(key)}")
        self._key = key

    def _aead(self) -> AESGCM:
        # One per call: a few microseconds against hundreds for a block, and the writer thread and the
        # loaders then share no cipher state at all.
        return AESGCM(self._key)

    def seal(self, name: bytes, header: bytes, payload: Bytes) -> bytearray:
        """`header`, a fresh nonce, and `payload` encrypted and authenticated with `name` and `header`."""
        size = memoryview(payload).nbytes
        out = bytearray(sealed_size(header, size))
        view = memoryview(out)
        nonce = os.urandom(NONCE_BYTES)
        view[: len(header)] = header
        view[len(header) : len(header) + NONCE_BYTES] = nonce
        self._aead().encrypt_into(
            nonce, payload, _associated_data(name, header), view[len(header) + NONCE_BYTES :]
        )
        return out

    def open(self, name: bytes, header: bytes, stored: Bytes, payload_bytes: int) -> bytearray:
        """The payload of `stored`, a value sealed under this key for `name` with exactly `header` and a
        payload of `payload_bytes`; raises Unsealable for anything else. Nothing is decrypted before the
        size and the header are checked, and no byte of the payload is returned unless the tag holds."""
        view = memoryview(stored)
        expected = sealed_size(header, payload_bytes)
        if view.nbytes != expected:
            raise Unsealable(f"{view.nbytes} bytes, a sealed block of this format has {expected}")
        if view[: len(header)] != header:
            raise Unsealable("not a block of this format version, dtype and shape")
        start = len(header) + NONCE_BYTES
        out = bytearray(payload_bytes)
        try:
            self._aead().decrypt_into(
                view[len(header) : start], view[start:], _associated_data(name, header), out
            )
        except InvalidTag as e:
            raise Unsealable(
                "does not open: sealed without this secret, for another block, or changed since"
            ) from e
        return out
