"""Where stored responses outlive the process: the --kv-disk folder, or the --kv-remote Redis.

A stored response holds a tenant's conversation, so it is sealed as the KV blocks are (cache/block_seal.py:
AES-256-GCM under a key derived from the server secret, for this purpose only): whoever reads the folder or
Redis without the secret gets nothing, and a value forged, edited or moved under another name does not open.
The header names the format's version: a value of another version (an older kvserve's) is refused as any
other that does not open, by name in the log. Its name is HMAC(name key, tenant | id): it gives away neither
the tenant nor the id, and the seal's associated data is that name, so a value copied from one tenant's name
to another's is refused. Anything that does not open is refused (a warning; the file is deleted), never
trusted, and a failure of the folder or of Redis is a miss: the memory copy stays
(server/responses/store.py).

Disk: `DIR/responses/<name>.resp`, folder 0700 and files 0600 (kvserve/private_files.py), written
under a temporary name, fsynced and renamed, read only as a private regular file of at most the
store's bytes per tenant; files older than the TTL are deleted at startup. Redis: key
`kvserve:response:<name>` with the TTL as its expiry, read only when STRLEN says it is within bounds.
"""

import contextlib
import hashlib
import hmac
import logging
import os
import tempfile
import time

from kvserve.cache.block_seal import OVERHEAD, BlockSeal, Unsealable
from kvserve.private_files import private_dir, read_private_file
from kvserve.secret import derive_key

log = logging.getLogger("kvserve.server")

SEAL_PURPOSE = "kvserve stored responses: seal v1"
NAME_PURPOSE = "kvserve stored responses: names v1"
# The format's version, in clear before the seal: 2 holds a HeldResponse's bytes (responses_store.py).
HEADER = b"KVSRESP2"
# What an older kvserve wrote (1: a response's JSON model); refused by name, never read.
_FORMAT_PREFIX = b"KVSRESP"
FOLDER = "responses"
_SUFFIX = ".resp"
REDIS_PREFIX = b"kvserve:response:"
REDIS_TIMEOUT_S = 0.5


class _Sealed:
    """Names and seals stored responses under keys derived from the server secret."""

    def __init__(self, secret: bytes) -> None:
        self._names = derive_key(secret, NAME_PURPOSE)
        self._seal = BlockSeal(derive_key(secret, SEAL_PURPOSE))

    def name(self, tenant: str, response_id: str) -> str:
        message = len(tenant).to_bytes(4, "little") + tenant.encode() + response_id.encode()
        return hmac.new(self._names, message, hashlib.sha256).hexdigest()

    def seal(self, name: str, data: bytes) -> bytes:
        return bytes(self._seal.seal(name.encode(), HEADER, data))

    def open(self, name: str, stored: bytes) -> bytes:
        if stored.startswith(_FORMAT_PREFIX) and not stored.startswith(HEADER):
            version = stored[len(_FORMAT_PREFIX) : len(HEADER)].decode(errors="replace")
            raise Unsealable(f"written by another kvserve version (format {version!r}); not read")
        return bytes(self._seal.open(name.encode(), HEADER, stored, len(stored) - len(HEADER) - OVERHEAD))


class DiskBackend:
    def __init__(self, directory: str, secret: bytes, ttl_s: float) -> None:
        self.directory = private_dir(directory, FOLDER)
        self._sealed = _Sealed(secret)
        self._sweep(ttl_s)

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name + _SUFFIX)

    def _sweep(self, ttl_s: float) -> None:
        """Delete what a killed writer left and what has expired (by its file's age, unread)."""
        oldest = time.time() - ttl_s
        for entry in os.scandir(self.directory):
            with contextlib.suppress(OSError):
                if not entry.name.endswith(_SUFFIX) or entry.stat(follow_symlinks=False).st_mtime < oldest:
                    os.unlink(entry.path)

    def save(self, tenant: str, response_id: str, data: bytes, ttl_s: float) -> None:
        name = self._sealed.name(tenant, response_id)
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(self._sealed.seal(name, data))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path(name))
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            log.warning("responses: could not write %s to disk: %s", response_id[:16], e)

    def load(self, tenant: str, response_id: str, max_bytes: int) -> bytes | None:
        name = self._sealed.name(tenant, response_id)
        path = self._path(name)
        try:
            stored = read_private_file(path, max_bytes + len(HEADER) + OVERHEAD)
            return self._sealed.open(name, stored)
        except FileNotFoundError:
            return None
        except (OSError, Unsealable) as e:
            log.warning("responses: refused the stored file of %s (%s); deleted", response_id[:16], e)
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None

    def delete(self, tenant: str, response_id: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self._path(self._sealed.name(tenant, response_id)))


class RedisBackend:
    def __init__(self, url: str, secret: bytes) -> None:
        # Imported here: a server without --kv-remote never loads the client (a tenth of a second).
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._error: type[Exception] = redis.RedisError
        self._sealed = _Sealed(secret)
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=REDIS_TIMEOUT_S,
            socket_connect_timeout=REDIS_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
        )

    def _key(self, name: str) -> bytes:
        return REDIS_PREFIX + name.encode()

    def save(self, tenant: str, response_id: str, data: bytes, ttl_s: float) -> None:
        name = self._sealed.name(tenant, response_id)
        try:
            self._client.set(self._key(name), self._sealed.seal(name, data), ex=max(1, int(ttl_s)))
        except self._error as e:
            log.warning("responses: could not write %s to redis: %s", response_id[:16], type(e).__name__)

    def load(self, tenant: str, response_id: str, max_bytes: int) -> bytes | None:
        name = self._sealed.name(tenant, response_id)
        key = self._key(name)
        try:
            size = self._client.strlen(key)
            if not size:
                return None
            if size > max_bytes + len(HEADER) + OVERHEAD:
                raise Unsealable(f"{size} bytes, more than a stored response may have; not read")
            stored = self._client.get(key)
            if not isinstance(stored, bytes):
                return None
            return self._sealed.open(name, stored)
        except self._error as e:
            log.warning("responses: could not read %s from redis: %s", response_id[:16], type(e).__name__)
            return None
        except Unsealable as e:
            log.warning("responses: refused the stored value of %s (%s)", response_id[:16], e)
            return None

    def delete(self, tenant: str, response_id: str) -> None:
        with contextlib.suppress(self._error):
            self._client.delete(self._key(self._sealed.name(tenant, response_id)))
