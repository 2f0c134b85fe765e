"""Credentials that reach a process without its command line, where `ps` would show them to every local
user: the Redis tier's password and the nonce by which `kvserve cluster` tells its own replicas apart.

The Redis password comes from a private file (`--kv-remote-password-file`, read once, refused unless
it is the server user's and 0600) or from `KVSERVE_KV_REMOTE_PASSWORD`; a `--kv-remote` URL that carries
one is refused (`check_url_without_password`). The server then hands the engine the URL with the
password put in (`url_with_password`): EngineConfig keeps it out of its repr.

The launch nonce is 32 random bytes that the launcher gives one replica in `KVSERVE_LAUNCH_NONCE` (the
environment of a process is readable by its own user only). The replica takes it out of its environment
(`take_launch_nonce`), so that nothing it starts inherits it, and answers a challenge with
`identity_proof`: an HMAC under the nonce, so that the nonce itself never crosses the socket, bound to
its PID, so that the launcher also learns that the answer comes from the process it spawned.
"""

import hashlib
import hmac
import os
from urllib.parse import parse_qs, quote, urlsplit

from kvserve.errors import ConfigError
from kvserve.private_files import read_private_file

KV_REMOTE_PASSWORD_ENV = "KVSERVE_KV_REMOTE_PASSWORD"
LAUNCH_NONCE_ENV = "KVSERVE_LAUNCH_NONCE"
# A Redis password file is one line; anything much longer is not one.
_MAX_PASSWORD_BYTES = 4096
_IDENTITY_PURPOSE = b"kvserve replica identity v1\0"


def check_url_without_password(option: str, url: str | None) -> None:
    """Refuses a Redis URL with a password in it (in its user part or as `?password=`), without
    repeating the URL: the message would show the password again, in a terminal or a log."""
    if url is None:
        return
    parts = urlsplit(url)
    if parts.password is not None or "password" in parse_qs(parts.query):
        raise ConfigError(
            f"{option} must not carry a password (the command line shows it to every local user): give it "
            f"in a file (--kv-remote-password-file FILE, mode 600) or in ${KV_REMOTE_PASSWORD_ENV}, and a "
            "URL without it, e.g. redis://USER@HOST:PORT/0"
        )


def read_kv_remote_password(path: str | None) -> str | None:
    """The Redis tier's password: the private file `path` (one line; surrounding whitespace dropped)
    when given, else $KVSERVE_KV_REMOTE_PASSWORD, else None."""
    if path is None:
        return os.environ.get(KV_REMOTE_PASSWORD_ENV) or None
    try:
        data = read_private_file(path, _MAX_PASSWORD_BYTES)
    except OSError as e:
        raise ConfigError(f"the Redis password file cannot be used: {e}") from e
    try:
        password = data.decode().strip()
    except UnicodeDecodeError as e:
        raise ConfigError(f"the Redis password file {path} is not UTF-8 text") from e
    if not password or "\n" in password:
        raise ConfigError(f"the Redis password file {path} must hold the password alone, on one line")
    return password


def url_with_password(url: str, password: str | None) -> str:
    """`url` (which has no password) with `password` put in its user part, after the user name if any,
    percent-encoded (redis-py decodes it)."""
    if password is None:
        return url
    parts = urlsplit(url)
    user, at, host = parts.netloc.rpartition("@")
    netloc = f"{user if at else ''}:{quote(password, safe='')}@{host}"
    return parts._replace(netloc=netloc).geturl()


def take_launch_nonce() -> bytes | None:
    """The launcher's nonce for this process (hex in $KVSERVE_LAUNCH_NONCE), removed from the
    environment; None when not launched by `kvserve cluster`."""
    text = os.environ.pop(LAUNCH_NONCE_ENV, None)
    if text is None:
        return None
    try:
        nonce = bytes.fromhex(text)
    except ValueError as e:
        raise ConfigError(f"${LAUNCH_NONCE_ENV} must be hex digits") from e
    if len(nonce) < 16:
        raise ConfigError(f"${LAUNCH_NONCE_ENV} must be at least 16 bytes")
    return nonce


def identity_proof(nonce: bytes, challenge: bytes, pid: int) -> str:
    """What a replica answers to `challenge`: HMAC-SHA256(nonce, purpose | challenge | pid), in hex."""
    message = _IDENTITY_PURPOSE + challenge + b"\0" + str(pid).encode()
    return hmac.new(nonce, message, hashlib.sha256).hexdigest()
