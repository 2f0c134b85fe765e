"""A redis-server child process on a loopback port, persistence off, memory bounded with LRU eviction:
the Redis tier's store for `make cluster`, the benchmarks and the tests."""

import shutil
import socket
import subprocess
import time

import redis


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisProcess:
    """`start` runs redis-server and waits until it answers; `stop` kills it (SIGKILL, as a crash would);
    `start` again brings a fresh, empty one back on the same port."""

    def __init__(self, port: int | None = None, maxmemory: str = "1gb", host: str = "127.0.0.1") -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is not installed: run `make deps` (apt-get install redis-server)"
            )
        self.binary = binary
        self.host = host
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.url = f"redis://{host}:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        # No snapshots, no append-only file: the tier is a cache, and Redis bounds it (LRU past maxmemory).
        return [
            self.binary,
            "--bind", self.host,
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--maxmemory", self.maxmemory,
            "--maxmemory-policy", "allkeys-lru",
        ]  # fmt: skip

    def start(self, timeout_s: float = 20) -> None:
        self.process = subprocess.Popen(self.argv(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = self.client()
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                    time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    def client(self) -> "redis.Redis":
        return redis.Redis(host=self.host, port=self.port, socket_timeout=5)
