"""Tenants: who is calling, from the API key, and which cache namespace that caller may read and write.

The prefix cache reports hits exact to the token (`cached_tokens`, and time to first token), so a client
sharing a namespace with another could confirm guesses about the other's prompts one token at a time.
Namespaces are therefore derived by the server from the caller's identity, never chosen by the client:
HMAC-SHA256(server secret, tenant or shared group, optional cache_salt). A client's `cache_salt` can only
split its own namespace further; no field names another tenant's.

Key file: one `tenant:key` or `tenant:key:shared-group` per line; `#` starts a comment. A tenant may have
several keys (rotation). Tenants that name the same shared group share one namespace, on purpose (a public
system prompt). The file is re-read on SIGHUP; a file that fails to parse leaves the old keys in force.
"""

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import signal
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from types import FrameType

from kvserve.errors import KVServeError

log = logging.getLogger("kvserve.server")

SECRET_FILE = "tenant-secret"
# The tenant of a server started with one key (--api-key) or with none.
DEFAULT_TENANT = "default"
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_KEY = re.compile(r"[\x21-\x39\x3b-\x7e]{8,512}")  # printable ASCII but ':', so that lines parse one way


class KeyFileError(KVServeError, ValueError):
    """The key file cannot be used; the message names the line, never a key."""


@dataclass(frozen=True)
class Tenant:
    """A caller. `group` is its shared group, or None when its namespace is its own."""

    name: str
    group: str | None = None


def load_or_create_secret(cache_dir: str, path: str | None = None) -> bytes:
    """The server secret: 32 random bytes, created once with mode 0600 in the cache folder and kept, so
    that namespaces (and KV written to disk under them) survive restarts. With `path` (a secret file
    that replicas share: `--tenant-secret-file`) it is read from there and never created."""
    if path is not None and not os.path.exists(path):
        raise KeyFileError(
            f"{path} does not exist; create it once and give every replica the same file: "
            f"python3 -c 'import secrets; print(secrets.token_hex(32))' > {path}; chmod 600 {path}"
        )
    os.makedirs(cache_dir, mode=0o700, exist_ok=True)
    path = path or os.path.join(cache_dir, SECRET_FILE)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"{path} is readable by others; run: chmod 600 {path}")
    with open(path) as f:
        secret = bytes.fromhex(f.read().strip())
    if len(secret) < 16:
        raise KeyFileError(f"{path} holds no usable secret; delete it to create a new one")
    return secret


def parse_key_file(text: str, source: str = "key file") -> dict[str, Tenant]:
    """`tenant:key[:shared-group]` lines -> {key: Tenant}."""
    keys: dict[str, Tenant] = {}
    groups: dict[str, str | None] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split(":")
        where = f"{source} line {number}"
        if len(fields) not in (2, 3):
            raise KeyFileError(f"{where}: expected tenant:key or tenant:key:shared-group")
        name, key = fields[0].strip(), fields[1].strip()
        group = fields[2].strip() if len(fields) == 3 else None
        if not _NAME.fullmatch(name) or (group is not None and not _NAME.fullmatch(group)):
            raise KeyFileError(f"{where}: tenant and group names are 1-64 of A-Z a-z 0-9 . _ -")
        if not _KEY.fullmatch(key):
            raise KeyFileError(f"{where}: a key is 8-512 printable ASCII characters without ':' or spaces")
        if key in keys:
            raise KeyFileError(f"{where}: this key is already given to tenant {keys[key].name!r}")
        if groups.setdefault(name, group) != group:
            raise KeyFileError(f"{where}: tenant {name!r} is given two different shared groups")
        keys[key] = Tenant(name, group)
    if not keys:
        raise KeyFileError(f"{source} has no keys")
    return keys


class Tenants:
    """The server's callers and their namespaces. Without keys the server is single-tenant: every
    client is DEFAULT_TENANT and shares its namespace (cache_salt still splits it)."""

    def __init__(self, secret: bytes, api_key: str | None = None, key_file: str | None = None) -> None:
        self._secret = secret
        self._api_key = api_key
        self.key_file = key_file
        self._keys = self._load()

    @property
    def single_tenant(self) -> bool:
        return not self._keys

    def authenticate(self, token: str | None) -> Tenant | None:
        """The tenant whose key `token` is, DEFAULT_TENANT when the server has no keys, else None.

        Every key is compared, each in constant time, so neither which key matched nor how much of one
        did shows in the time taken."""
        if not self._keys:
            return Tenant(DEFAULT_TENANT)
        if token is None:
            return None
        given = token.encode()
        found: Tenant | None = None
        for key, tenant in self._keys.items():
            if secrets.compare_digest(given, key.encode()):
                found = tenant
        return found

    def namespace(self, tenant: Tenant, cache_salt: str | None = None) -> str:
        """The cache namespace of a tenant's request: a keyed hash, so it can be neither guessed nor
        chosen; members of a shared group get the group's."""
        owner = ["group", tenant.group] if tenant.group is not None else ["tenant", tenant.name]
        message = json.dumps([*owner, cache_salt]).encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def label(self, namespace: str, others: Iterable[Tenant] = ()) -> str:
        """A readable name for a namespace (the dashboard's): its tenant's or shared group's among the
        known tenants and `others`; for a salted or unknown one, the start of its hash."""
        for tenant in {*self._keys.values(), Tenant(DEFAULT_TENANT), *others}:
            if hmac.compare_digest(self.namespace(tenant), namespace):
                return f"group {tenant.group}" if tenant.group is not None else tenant.name
        return namespace[:12]

    def reload(self) -> None:
        """Re-read the key file (SIGHUP); on any error the keys in force stay."""
        try:
            keys = self._load()
        except (OSError, KeyFileError) as e:
            log.error("key file not reloaded, the previous keys stay in force: %s", e)
            return
        self._keys = keys
        log.info("key file reloaded: %d keys, %d tenants", len(keys), len({t.name for t in keys.values()}))

    def install_sighup_reload(self) -> None:
        """Re-read the key file on SIGHUP (main thread only, as Python's signal handlers are)."""

        def on_sighup(signum: int, frame: FrameType | None) -> None:
            self.reload()

        if self.key_file is not None:
            signal.signal(signal.SIGHUP, on_sighup)

    def describe(self) -> str:
        if self.single_tenant:
            return (
                "single-tenant: no API key is set, so every client shares one prefix-cache namespace "
                "and can see the others' cache hits (use --api-key-file to isolate tenants)"
            )
        names = {t.name for t in self._keys.values()}
        return f"{len(names)} tenants, each in its own prefix-cache namespace unless a shared group says so"

    def _load(self) -> dict[str, Tenant]:
        keys: dict[str, Tenant] = {}
        if self.key_file is not None:
            with open(self.key_file, encoding="utf-8") as f:
                keys = parse_key_file(f.read(), self.key_file)
        if self._api_key is not None:
            if self._api_key in keys:
                raise KeyFileError("--api-key is also a key in the key file")
            keys[self._api_key] = Tenant(DEFAULT_TENANT)
        return keys
