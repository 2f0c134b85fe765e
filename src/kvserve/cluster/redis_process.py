"""A redis-server child process on a loopback port, persistence off, memory bounded with LRU eviction,
closed to whoever has no password: the Redis tier's store for `make cluster`, the benchmarks and the
tests.

Closed by default. Its configuration is a file in a private folder (0700; the file 0600), never its
command line, which every local user can read with `ps`. The file turns the default user off (a client
that has not authenticated can run nothing: NOAUTH) and declares two users with generated passwords
(stored there as SHA-256 hashes, so the file alone opens nothing):

- `kvserve`, the replicas' user: every key, every command but Redis' `@dangerous` category (CONFIG,
  SAVE, BGSAVE, FLUSHALL, FLUSHDB, DEBUG, MODULE, KEYS, INFO, CLIENT KILL and PAUSE, SHUTDOWN, ACL,
  REPLICAOF, MIGRATE, MONITOR, ...). A leaked replica password can read and write the cache's values,
  which the tier's MACs guard, but cannot reconfigure Redis, dump it to disk or wipe it.
- `admin`, for the launcher and the tests (`client()`): everything.

`protected-mode yes` on top; DEBUG and MODULE are also disabled for every user (Redis' own
`enable-*-command no`, which CONFIG SET cannot change).
"""

import hashlib
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from urllib.parse import quote

import redis

from kvserve.private_files import private_dir

# The replicas' user and the administrator's (see the module's docstring).
REPLICA_USER = "kvserve"
ADMIN_USER = "admin"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisProcess:
    """`start` runs redis-server and waits until it answers; `stop` kills it (SIGKILL, as a crash would);
    `start` again brings a fresh, empty one back on the same port, with the same passwords.

    `run_dir` is the private folder of its configuration (made 0700 if missing); without one, a new
    temporary folder for each start, removed by `stop`. `password` is the replicas' (user `kvserve`),
    `public_url` their URL without it (for a command line or a log) and `url` the same with it, for
    clients in this process."""

    def __init__(
        self,
        port: int | None = None,
        maxmemory: str = "1gb",
        host: str = "127.0.0.1",
        run_dir: str | None = None,
    ) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is not installed: run `make deps` (apt-get install redis-server)"
            )
        self.binary = binary
        self.host = host
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.run_dir = run_dir
        self.password = secrets.token_urlsafe(32)
        self._admin_password = secrets.token_urlsafe(32)
        self.public_url = f"redis://{REPLICA_USER}@{host}:{self.port}/0"
        self.url = f"redis://{REPLICA_USER}:{quote(self.password, safe='')}@{host}:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None
        self._temp_dir: str | None = None

    def config(self, folder: str) -> str:
        """redis.conf's text: the server's settings and its users (passwords as SHA-256 hashes)."""
        replica = hashlib.sha256(self.password.encode()).hexdigest()
        admin = hashlib.sha256(self._admin_password.encode()).hexdigest()
        # No snapshots, no append-only file: the tier is a cache, and Redis bounds it (LRU past maxmemory).
        lines = [
            f"bind {self.host}",
            f"port {self.port}",
            "protected-mode yes",
            'save ""',
            "appendonly no",
            f"maxmemory {self.maxmemory}",
            "maxmemory-policy allkeys-lru",
            f"dir {folder}",
            "enable-debug-command no",
            "enable-module-command no",
            "user default off",
            f"user {ADMIN_USER} on #{admin} ~* &* +@all",
            f"user {REPLICA_USER} on #{replica} ~* resetchannels +@all -@dangerous",
        ]
        return "\n".join(lines) + "\n"

    def _write_config(self) -> str:
        if self.run_dir is not None:
            folder = private_dir(self.run_dir)
        else:
            folder = self._temp_dir = tempfile.mkdtemp(prefix="kvserve-redis-")
        path = os.path.join(folder, "redis.conf")
        if os.path.lexists(path):
            os.unlink(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.config(folder))
        return path

    def argv(self, config_path: str) -> list[str]:
        return [self.binary, config_path]

    def start(self, timeout_s: float = 20) -> None:
        config_path = self._write_config()
        self.process = subprocess.Popen(
            self.argv(config_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        client = self.client()
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                    time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    def client(self) -> "redis.Redis":
        """A client as the administrator (every command)."""
        return redis.Redis(
            host=self.host,
            port=self.port,
            username=ADMIN_USER,
            password=self._admin_password,
            socket_timeout=5,
        )
