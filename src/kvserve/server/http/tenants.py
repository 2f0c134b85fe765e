"""Tenants: who is calling, from the API key, and which cache namespace that caller may read and write.

The prefix cache reports hits exact to the token (`cached_tokens`, and time to first token), so a client
sharing a namespace with another could confirm guesses about the other's prompts one token at a time.
Namespaces are therefore derived by the server from the caller's identity, never chosen by the client:
HMAC-SHA256(server secret, tenant or shared group, optional cache_salt). A client's `cache_salt` can only
split its own namespace further; no field names another tenant's.

Key file: one `tenant:key` or `tenant:key:shared-group` per line; `#` at the start of a line or after
whitespace starts a comment (a `#` inside a key is part of it). A tenant may have several keys (rotation).
Tenants that name the same shared group share one namespace, on purpose (a public system prompt). The
file is re-read on SIGHUP; a file that fails to parse, or does not end with a newline (it may be caught
half-written: replace it atomically), leaves the old keys in force.

Every key, --api-key and --admin-key included, follows one rule (8-512 printable ASCII characters, no
':' or spaces), so an empty one (`KVSERVE_ADMIN_KEY=` from an unset docker-compose variable) stops the
server at startup instead of letting a bare `Authorization: Bearer` in. The admin key differs from every
tenant key, on every reload too.
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

# The server loads its secret through this module (it keeps its own file: kvserve/secret.py).
from kvserve.secret import SECRET_FILE, load_or_create_secret

__all__ = ["SECRET_FILE", "KeyFileError", "Tenant", "Tenants", "load_or_create_secret", "parse_key_file"]

log = logging.getLogger("kvserve.server")

# The tenant of a server started with one key (--api-key) or with none.
DEFAULT_TENANT = "default"
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_KEY = re.compile(r"[\x21-\x39\x3b-\x7e]{8,512}")  # printable ASCII but ':', so that lines parse one way
_KEY_RULE = "a key is 8-512 printable ASCII characters without ':' or spaces"
# A comment: '#' at the start of a line or after whitespace, to the end of the line.
_COMMENT = re.compile(r"(?:^|\s)#.*")
MAX_KEY_FILE_BYTES = 1 << 20
API_KEY = "the API key (--api-key or $KVSERVE_API_KEY)"
ADMIN_KEY = "the admin key (--admin-key or $KVSERVE_ADMIN_KEY)"


class KeyFileError(KVServeError, ValueError):
    """A key (the key file, --api-key, --admin-key) cannot be used; the message says where, never a key."""


def check_key(key: str, what: str) -> str:
    """`key` if it follows the key rule, else a KeyFileError naming `what`."""
    if not key.strip():
        raise KeyFileError(
            f"{what} is empty: give a key, or leave it unset (docker-compose sets an unset variable "
            "to an empty one: remove it from the environment list)"
        )
    if not _KEY.fullmatch(key):
        raise KeyFileError(f"{what} does not follow the key rule: {_KEY_RULE}")
    return key


@dataclass(frozen=True)
class Tenant:
    """A caller. `group` is its shared group, or None when its namespace is its own."""

    name: str
    group: str | None = None


def parse_key_file(text: str, source: str = "key file") -> dict[str, Tenant]:
    """`tenant:key[:shared-group]` lines -> {key: Tenant}."""
    keys: dict[str, Tenant] = {}
    groups: dict[str, str | None] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = _COMMENT.sub("", raw).strip()
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
            raise KeyFileError(f"{where}: {_KEY_RULE}")
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

    def __init__(
        self,
        secret: bytes,
        api_key: str | None = None,
        key_file: str | None = None,
        admin_key: str | None = None,
    ) -> None:
        self._secret = secret
        self._api_key = None if api_key is None else check_key(api_key, API_KEY)
        self.admin_key = None if admin_key is None else check_key(admin_key, ADMIN_KEY)
        self.key_file = key_file
        self._keys = self._load()

    def set_admin_key(self, admin_key: str | None) -> None:
        """Set (or, with None, clear) the admin key, after checking it against the rule and every key."""
        if admin_key is not None:
            check_key(admin_key, ADMIN_KEY)
            if admin_key in self._keys:
                raise KeyFileError(f"{ADMIN_KEY} is also a tenant's key: it must differ from every one")
        self.admin_key = admin_key

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
            keys = parse_key_file(read_key_file(self.key_file), self.key_file)
        if self._api_key is not None:
            if self._api_key in keys:
                raise KeyFileError("--api-key is also a key in the key file")
            keys[self._api_key] = Tenant(DEFAULT_TENANT)
        if self.admin_key is not None and self.admin_key in keys:
            raise KeyFileError(f"{ADMIN_KEY} is also a tenant's key: it must differ from every one")
        return keys


def read_key_file(path: str) -> str:
    """The text of a key file that is whole: UTF-8, at most MAX_KEY_FILE_BYTES, ending with a newline."""
    # Symlinks are followed (a Kubernetes secret volume is one); a FIFO must not block the reload.
    with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise KeyFileError(f"{path} is not a regular file")
        data = f.read(MAX_KEY_FILE_BYTES + 1)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise KeyFileError(f"{path} is larger than {MAX_KEY_FILE_BYTES} bytes")
    if data and not data.endswith(b"\n"):
        raise KeyFileError(
            f"{path} does not end with a newline, so it may be half-written; replace it atomically "
            "(write a new file next to it, then rename it over the old one)"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise KeyFileError(f"{path} is not UTF-8 text (byte {e.start})") from e
