"""Cluster: redis-server, N kvserve replicas sharing it (one tenant secret, the threads split between
them) and the SMG router in front, as child processes of one command (`kvserve cluster`, `make
cluster`). Each part logs to its own file in the run folder; `stop` ends them all.

Closed by default. The run folder is private (0700) and holds the credentials the parts share, each in
a 0600 file and none on a command line: Redis needs a password (redis_process.py; the replicas get
theirs with --kv-remote-password-file), SMG's control plane (/workers: list, add and remove replicas)
needs a generated key (router.py puts it in SMG's arguments in-process), SMG's Prometheus port binds
loopback, and a replica is handed to the router only once it has proved to be the process the launcher
spawned: the launcher gives each replica a random nonce in its environment and checks that what answers
on the replica's port returns HMAC(nonce, a fresh challenge) and the PID it spawned (kvserve.credentials),
so that a local process that took the port first is refused, not routed to.
"""

import hmac
import importlib.util
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

import httpx

from kvserve.cluster.redis_process import RedisProcess, free_port
from kvserve.cluster.router import CONTROL_PLANE_KEY_ENV
from kvserve.credentials import LAUNCH_NONCE_ENV, identity_proof
from kvserve.errors import ConfigError
from kvserve.flags import option
from kvserve.private_files import private_dir
from kvserve.secret import read_secret

log = logging.getLogger("kvserve.cluster")

# SMG probes each replica this often and drops it after this many failures: a dead replica stops
# getting new requests within about interval * threshold seconds.
HEALTH_INTERVAL_S = 2
HEALTH_FAILURES = 1


# SMG's routing policies (`smg launch --policy`, 1.13).
SMG_POLICIES = (
    "cache_aware",
    "round_robin",
    "random",
    "power_of_two",
    "least_load",
    "consistent_hashing",
    "prefix_hash",
    "passthrough",
    "manual",
)

# Redis's memory sizes: bytes, or a number with k, kb, m, mb, g or gb, any case.
_REDIS_SIZE = re.compile(r"[0-9]+([kmg]b?)?", re.IGNORECASE)


@dataclass(frozen=True)
class ClusterConfig:
    """What `kvserve cluster` runs: `replicas` servers on `threads` torch threads split between them,
    behind the router on `host`:`port`, sharing one Redis bounded by `redis_maxmemory` (unless `redis`
    is off) and one tenant secret file. `serve_args` go to every replica's `kvserve serve` after the
    cluster's own. Validated on construction (ConfigError), before any process starts."""

    replicas: int = option(2)
    threads: int = option(os.cpu_count() or 2, "torch threads, split between the replicas")
    host: str = option("127.0.0.1", "the router's address")
    port: int = option(8000, "the router's port")
    policy: str = option("cache_aware", "SMG's routing policy (default %(default)s)", choices=SMG_POLICIES)
    redis: bool = option(True, "replicas without the shared Redis tier", name="--no-redis")
    redis_maxmemory: str = option("1gb", "Redis' bound (LRU past it)")
    tenant_secret_file: str | None = option(
        None,
        "the replicas' shared secret (default: $KVSERVE_TENANT_SECRET_FILE, else a new one in the run "
        "folder)",
        env="KVSERVE_TENANT_SECRET_FILE",
    )
    serve_args: Sequence[str] = ()
    run_dir: str | None = None

    def __post_init__(self) -> None:
        # Kept as a tuple (a caller may pass a list); a bare string would read as one argument per letter.
        if isinstance(self.serve_args, str):
            raise ConfigError("serve_args must be a sequence of arguments, not one string")
        object.__setattr__(self, "serve_args", tuple(self.serve_args))
        checks: list[tuple[bool, str]] = [
            (self.replicas >= 1, f"replicas must be at least 1, not {self.replicas}"),
            (self.threads >= 1, f"threads must be at least 1, not {self.threads}"),
            (0 < self.port < 2**16, f"port must be between 1 and 65535, not {self.port}"),
            (bool(self.host), "host must not be empty"),
            (self.policy in SMG_POLICIES, f"policy must be one of {', '.join(SMG_POLICIES)}"),
            (
                _REDIS_SIZE.fullmatch(self.redis_maxmemory) is not None,
                f"redis_maxmemory must be a Redis size such as 512mb or 1gb, not {self.redis_maxmemory!r}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


@dataclass
class Replica:
    port: int
    argv: list[str]
    log_path: str
    # In the child's environment, never on its command line: it proves who answers (see `_wait_replica`).
    nonce: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def router_command() -> list[str]:
    """SMG's launcher, run by this interpreter through router.py (which gives it its control-plane key)."""
    if importlib.util.find_spec("smg") is None:
        raise RuntimeError("smg is not installed: pip install -e '.[cluster]' (or `make cluster`)")
    return [sys.executable, "-m", "kvserve.cluster.router"]


def write_private(path: str, text: str) -> str:
    """A new file (0600; refused if something is there already) holding `text`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def write_secret(path: str) -> str:
    return write_private(path, secrets.token_hex(32) + "\n")


def _wait_replica(replica: Replica, what: str, timeout_s: float) -> None:
    """Until the replica answers /identity with the proof of its nonce and its PID, then /health with
    200. Any other answer on its port comes from another process: RuntimeError at once, since the
    replica itself could never bind the port."""
    process = replica.process
    assert process is not None
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode}")
        challenge = secrets.token_bytes(32)
        try:
            r = httpx.get(f"{replica.url}/identity", params={"challenge": challenge.hex()}, timeout=2)
            if not _proves(r, replica.nonce, challenge, process.pid):
                raise RuntimeError(
                    f"port {replica.port} answers, but not as the replica started there (PID {process.pid}): "
                    "another local process holds it; stop it, or start the cluster again (new ports)"
                )
            if httpx.get(f"{replica.url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer {replica.url} within {timeout_s:.0f}s")
        time.sleep(0.2)


def _proves(response: httpx.Response, nonce: bytes, challenge: bytes, pid: int) -> bool:
    """Whether `response` is a replica's /identity answer for `nonce`, `challenge` and `pid`."""
    if response.status_code != 200:
        return False
    try:
        body = response.json()
    except ValueError:
        return False
    if not isinstance(body, dict) or body.get("pid") != pid or not isinstance(body.get("proof"), str):
        return False
    return hmac.compare_digest(body["proof"].encode(), identity_proof(nonce, challenge, pid).encode())


def _wait_http(url: str, process: subprocess.Popen[bytes], what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer {url} within {timeout_s:.0f}s")
        time.sleep(0.2)


class Cluster:
    def __init__(self, config: ClusterConfig) -> None:
        """Raises SecretError for a secret file the replicas could not read (once, before anything
        starts, rather than once per replica) and RuntimeError when redis-server is missing."""
        if config.tenant_secret_file is not None:
            read_secret(config.tenant_secret_file)
        self.config = config
        self.run_dir = private_dir(config.run_dir or tempfile.mkdtemp(prefix="kvserve-cluster-"))
        self.redis: RedisProcess | None = None
        self.redis_password_file: str | None = None
        if config.redis:
            self.redis = RedisProcess(
                maxmemory=config.redis_maxmemory, run_dir=os.path.join(self.run_dir, "redis")
            )
            self.redis_password_file = write_private(
                os.path.join(self.run_dir, "redis-password"), self.redis.password + "\n"
            )
        self.secret_file = config.tenant_secret_file or write_secret(
            os.path.join(self.run_dir, "tenant-secret")
        )
        # SMG's control plane (/workers) answers only to this key; it is in this file for the operator.
        self.control_plane_key = secrets.token_urlsafe(32)
        self.control_plane_key_file = write_private(
            os.path.join(self.run_dir, "router-control-plane-key"), self.control_plane_key + "\n"
        )
        threads = max(1, config.threads // config.replicas)
        self.replicas = [self._replica(i, free_port(), threads) for i in range(config.replicas)]
        self.router: subprocess.Popen[bytes] | None = None
        self._logs: list[IO[bytes]] = []
        self._forgotten: set[int] = set()

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def _replica(self, i: int, port: int, threads: int) -> Replica:
        argv = [
            sys.executable, "-m", "kvserve", "serve",
            "--host", "127.0.0.1",
            "--port", str(port),
            "--threads", str(threads),
            "--tenant-secret-file", self.secret_file,
        ]  # fmt: skip
        if self.redis is not None and self.redis_password_file is not None:
            argv += [
                "--kv-remote",
                self.redis.public_url,
                "--kv-remote-password-file",
                self.redis_password_file,
            ]
        argv += self.config.serve_args
        return Replica(port, argv, os.path.join(self.run_dir, f"replica-{i}.log"))

    def _spawn(self, argv: list[str], log_path: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        """`argv` with the launcher's environment plus `env` (credentials: never on the command line)."""
        out = open(log_path, "ab")  # noqa: SIM115 (closed by stop())
        self._logs.append(out)
        # Its own process group: Ctrl-C in the terminal reaches the launcher, which stops children in order.
        return subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **env},
        )

    def start_replica(self, i: int, timeout_s: float = 300) -> None:
        replica = self.replicas[i]
        replica.process = self._spawn(replica.argv, replica.log_path, {LAUNCH_NONCE_ENV: replica.nonce.hex()})
        _wait_replica(replica, f"replica {i} (log: {replica.log_path})", timeout_s)

    def kill_replica(self, i: int) -> None:
        """SIGKILL, as a crashed machine: streams in flight on it break."""
        process = self.replicas[i].process
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()

    def forget_exited_replicas(self) -> list[int]:
        """The replicas that exited since the last call, each removed from the router through its
        control plane: SMG's health checks alone would take back whatever binds the freed port next
        and answers /health."""
        exited = []
        for i, r in enumerate(self.replicas):
            if i not in self._forgotten and r.process is not None and r.process.poll() is not None:
                self._forgotten.add(i)
                exited.append(i)
                self._remove_worker(r.url)
        return exited

    def _remove_worker(self, url: str) -> None:
        headers = {"Authorization": f"Bearer {self.control_plane_key}"}
        try:
            listed = httpx.get(f"{self.url}/workers", headers=headers, timeout=10)
            listed.raise_for_status()
            for worker in listed.json()["workers"]:
                if worker.get("url") == url:
                    httpx.delete(f"{self.url}/workers/{worker['id']}", headers=headers, timeout=10)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            log.warning("could not remove %s from the router: %s", url, e)

    def router_argv(self) -> list[str]:
        c = self.config
        return [
            *router_command(),
            "--host", c.host,
            "--port", str(c.port),
            "--policy", c.policy,
            "--worker-urls", *(r.url for r in self.replicas),
            "--health-check-interval-secs", str(HEALTH_INTERVAL_S),
            "--health-failure-threshold", str(HEALTH_FAILURES),
            "--health-success-threshold", "1",
            "--health-check-timeout-secs", "2",
            "--health-check-endpoint", "/health",
            "--worker-startup-check-interval", "1",
            "--prometheus-port", str(free_port()),
            "--prometheus-host", "127.0.0.1",
            "--log-level", "warn",
        ]  # fmt: skip

    def start(self) -> None:
        try:
            if self.redis is not None:
                self.redis.start()
            # One at a time: replicas loading the model together only compete for the same cores.
            for i in range(len(self.replicas)):
                self.start_replica(i)
            self.router = self._spawn(
                self.router_argv(),
                os.path.join(self.run_dir, "smg.log"),
                {CONTROL_PLANE_KEY_ENV: self.control_plane_key},
            )
            _wait_http(f"{self.url}/v1/models", self.router, f"smg (log: {self.run_dir}/smg.log)", 120)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        processes = [self.router, *(r.process for r in self.replicas)]
        for p in processes:
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in processes:
            if p is None:
                continue
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.redis is not None:
            self.redis.stop()
        for f in self._logs:
            f.close()
        self._logs.clear()


def run_until_interrupted(config: ClusterConfig) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        cluster = Cluster(config)
        print(f"starting {config.replicas} replicas (logs in {cluster.run_dir}) ...", flush=True)
        cluster.start()
    except RuntimeError as e:
        print(f"kvserve cluster: {e}", file=sys.stderr)
        return 1
    redis_url = cluster.redis.public_url if cluster.redis is not None else "off"
    print(
        f"kvserve cluster ready: {cluster.url}/v1 (SMG {config.policy}), replicas "
        f"{', '.join(r.url for r in cluster.replicas)}, redis {redis_url} (password in "
        f"{cluster.redis_password_file}), SMG's control plane key in {cluster.control_plane_key_file}; "
        "Ctrl-C stops everything",
        flush=True,
    )
    try:
        # A replica that dies is reported and removed from the router, not replaced.
        exited = 0
        while cluster.router is not None and cluster.router.poll() is None:
            for i in cluster.forget_exited_replicas():
                exited += 1
                log_path = cluster.replicas[i].log_path
                print(f"kvserve cluster: replica {i} exited (log: {log_path})", file=sys.stderr)
            if exited == len(cluster.replicas):
                print("kvserve cluster: every replica exited; stopping", file=sys.stderr)
                return 1
            time.sleep(1)
        print("kvserve cluster: the router exited; stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        cluster.stop()
