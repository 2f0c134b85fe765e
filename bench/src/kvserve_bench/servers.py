"""Local kvserve servers for `kvserve bench compare`: started on free loopback ports, stopped afterwards."""

import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import IO

import httpx

from kvserve_bench.errors import BenchError

_HOST = "127.0.0.1"


@contextmanager
def local_servers(flag_sets: Sequence[Sequence[str]], startup_timeout_s: float) -> Iterator[list[str]]:
    """Starts one `kvserve serve` per flag set, in order, each once the one before is healthy; yields their
    base URLs, stops them. One at a time: a server times its steps once it listens (speculation's startup
    probe), and another server's start beside it would skew what it measures."""
    with ExitStack() as stack:
        urls: list[str] = []
        for flags, port in zip(flag_sets, _free_ports(len(flag_sets)), strict=True):
            command = [sys.executable, "-m", "kvserve", "serve", "--host", _HOST, "--port", str(port), *flags]
            log: IO[bytes] = stack.enter_context(tempfile.TemporaryFile())
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            stack.callback(_stop, process)
            urls.append(f"http://{_HOST}:{port}")
            _wait_healthy(command, process, log, urls[-1], startup_timeout_s)
        yield urls


def _free_ports(n: int) -> list[int]:
    # All sockets stay open until every port is known, so the n ports are distinct.
    with ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind((_HOST, 0))
        return [int(s.getsockname()[1]) for s in sockets]


def _wait_healthy(
    command: list[str], process: subprocess.Popen[bytes], log: IO[bytes], url: str, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise BenchError(f"{' '.join(command[1:])} exited with code {process.returncode}: {tail[0]}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        # Often enough that the time a server took to start is known to a tenth of a second.
        time.sleep(0.1)
    raise BenchError(f"{' '.join(command[1:])} was not healthy after {timeout_s:.0f} s")


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
