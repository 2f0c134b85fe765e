"""The server secret: 32 random bytes, kept in the cache folder, from which every keyed hash is derived.

Tenant namespaces are HMACs under it (server/http/tenants.py), and the blocks that the disk and Redis tiers
store are sealed (encrypted and authenticated, cache/block_seal.py) under keys derived from it
(`derive_key(secret, DISK_TIER_SEAL_PURPOSE)`), so that whoever lacks the secret can neither read a
stored block nor have one served. It is kept across restarts, so that namespaces, and the KV written
to disk under them, survive them.

The file holds the secret in hex (at least 16 bytes). It is created atomically (written under a temporary
name, then linked into place), so a crash never leaves an empty or partial file, and it is read only if
it is private (see private_files.py).
"""

import hashlib
import hmac
import os
import secrets
import string

from kvserve.errors import KVServeError
from kvserve.private_files import create_private_file, private_dir, read_private_file

SECRET_FILE = "tenant-secret"
SECRET_BYTES = 32
MIN_SECRET_BYTES = 16
# Purposes of derived keys: one key per use, so that nothing sealed or hashed for one use is valid in
# another.
DISK_TIER_SEAL_PURPOSE = "kvserve disk tier: block seal v3"
REDIS_KEY_NAMES_PURPOSE = "kvserve redis tier: key names"
REDIS_VALUE_SEAL_PURPOSE = "kvserve redis tier: value seal v2"


class SecretError(KVServeError):
    """The secret file cannot be used; the message says why and how to fix it (never the secret)."""


def read_secret(path: str) -> bytes:
    """The secret in the private file `path`: hex digits (whitespace around them is ignored)."""
    try:
        text = read_private_file(path, max_bytes=4096)
    except FileNotFoundError as e:
        raise SecretError(
            f"the secret file {path} does not exist; create it once (python3 -c 'import secrets; "
            f"print(secrets.token_hex(32))' > {path}; chmod 600 {path}) and give every replica the same file"
        ) from e
    except OSError as e:
        raise SecretError(f"the secret file cannot be used: {e}") from e
    digits = text.strip()
    if not digits:
        raise SecretError(f"the secret file {path} is empty; delete it to create a new one")
    if len(digits) % 2 or any(chr(c) not in string.hexdigits for c in digits):
        raise SecretError(f"the secret file {path} does not hold hex digits; delete it to create a new one")
    secret = bytes.fromhex(digits.decode())
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(
            f"the secret in {path} is {len(secret)} bytes, fewer than {MIN_SECRET_BYTES}; "
            "delete it to create a new one"
        )
    return secret


def load_or_create_secret(cache_dir: str) -> bytes:
    """The secret of the cache folder `cache_dir` (made private if missing), created on first use."""
    try:
        folder = private_dir(cache_dir)
    except OSError as e:
        raise SecretError(f"the cache folder cannot hold the secret: {e}") from e
    path = os.path.join(folder, SECRET_FILE)
    try:
        create_private_file(path, (secrets.token_hex(SECRET_BYTES) + "\n").encode())
    except OSError as e:
        raise SecretError(f"cannot create the secret file {path}: {e}") from e
    return read_secret(path)


def derive_key(secret: bytes, purpose: str) -> bytes:
    """A 32-byte key for one purpose, from the secret: HMAC-SHA256(secret, purpose)."""
    return hmac.new(secret, purpose.encode(), hashlib.sha256).digest()
