"""Load to ready. Without --model: on the default model, `build_parts` loading the GGUF, at a first
start (a fresh cache folder holding only the built kernels) and at a later one, and the bytes the first
start writes to the cache folder besides the kernels. `python -m benchmarks.bench_load [--repeats 3]`.

With --model FILE.gguf: `kvserve serve --model FILE` from process start to `/health` answering, beside
llama-server on the same file (bench_peer's command line, 2 threads each): kvserve's first start on a
fresh cache folder holding only the built kernels (it builds the file's tokenizer), then --repeats later
starts of each server, one after the other, with speculation on (the default: the startup probe runs)
and off, reporting each one's median and the load average. One process per start, so that nothing of one
start is warm in the next but the page cache."""

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import httpx
import psutil

from benchmarks.bench_peer import build_llama_server, llama_argv
from kvserve.config import default_cache_dir

_START = """
import json, os, time
t = time.monotonic()
from kvserve.config import EngineConfig
from kvserve.engine.factory import build_parts
imported = time.monotonic()
build_parts(EngineConfig(kv_cache_memory=64 * 2**20, cache_dir=os.environ["KVSERVE_CACHE_DIR"]))
print(json.dumps({"import_s": imported - t, "build_parts_s": time.monotonic() - imported}))
"""


def _start(cache: str) -> dict[str, float]:
    env = {**os.environ, "KVSERVE_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, "-c", _START], env=env, capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _written(cache: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(cache)
        if os.path.relpath(root, cache).split(os.sep)[0] != "kernels"
        for name in names
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def time_to_health(argv: Sequence[str], port: int, env: dict[str, str] | None = None) -> tuple[float, float]:
    """Seconds from starting `argv` to its `/health` answering 200 on `port` (polled every 20 ms), and
    the CPU seconds the process had taken by then (user and system; less swayed by the machine's other
    load than the wall time). The port must be free (another server's answer would time nothing)."""
    url = f"http://127.0.0.1:{port}/health"
    with socket.socket() as s:
        # Connections of the last start may wait out their close on it; a listener may not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    start = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        while True:
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    wall = time.perf_counter() - start
                    cpu = psutil.Process(process.pid).cpu_times()
                    return wall, cpu.user + cpu.system
            except httpx.HTTPError:
                pass
            if process.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited with code {process.returncode} before answering")
            time.sleep(0.02)
    finally:
        process.terminate()
        process.wait()


def kvserve_argv(model: str, port: int, speculative: bool) -> list[str]:
    argv = [sys.executable, "-m", "kvserve", "serve", "--model", model, "--port", str(port), "--threads", "2"]
    return argv if speculative else [*argv, "--speculative", "off"]


def serve_starts(model: str, repeats: int) -> None:
    """kvserve's and llama-server's load to ready on `model` (see the module's doc)."""
    binary = build_llama_server(os.path.join(default_cache_dir(), "peer"))
    port = free_port()
    kernels = os.path.join(default_cache_dir(), "kernels")
    time_to_health(kvserve_argv(model, port, False), port)  # builds the kernels and the tokenizer, if not yet
    with tempfile.TemporaryDirectory() as cache:
        shutil.copytree(kernels, os.path.join(cache, "kernels"))
        env = {**os.environ, "KVSERVE_CACHE_DIR": cache}
        first, first_cpu = time_to_health(kvserve_argv(model, port, False), port, env)
    print(
        f"load average {os.getloadavg()[0]:.2f}; kvserve --speculative off, first start (fresh cache folder):"
    )
    print(f"  {first:.2f} s ({first_cpu:.2f} s CPU)")
    starts: dict[str, list[tuple[float, float]]] = {
        "kvserve": [],
        "kvserve --speculative off": [],
        "llama-server": [],
    }
    for _ in range(repeats):
        starts["llama-server"].append(time_to_health(llama_argv(binary, model, port, False), port))
        starts["kvserve"].append(time_to_health(kvserve_argv(model, port, True), port))
        starts["kvserve --speculative off"].append(time_to_health(kvserve_argv(model, port, False), port))
    llama = statistics.median(wall for wall, _ in starts["llama-server"])
    llama_cpu = statistics.median(cpu for _, cpu in starts["llama-server"])
    for name, times in starts.items():
        wall = statistics.median(w for w, _ in times)
        cpu = statistics.median(c for _, c in times)
        runs = ", ".join(f"{w:.2f}" for w, _ in times)
        print(
            f"{name}: median {wall:.2f} s, {wall / llama:.2f}x llama-server's (runs {runs}); "
            f"CPU {cpu:.2f} s, {cpu / llama_cpu:.2f}x"
        )
    print(f"load average {os.getloadavg()[0]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", help="a GGUF: time `kvserve serve` to /health beside llama-server")
    args = parser.parse_args()
    if args.model:
        serve_starts(args.model, args.repeats)
        return
    kernels = os.path.join(default_cache_dir(), "kernels")
    _start(default_cache_dir())  # builds the kernels once, if they are not yet
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            shutil.copytree(kernels, os.path.join(cache, "kernels"))
            first = _start(cache)
            written = _written(cache)
            later = _start(cache)
        print(
            f"run {i + 1}: first start build_parts {first['build_parts_s']:.2f} s (imports "
            f"{first['import_s']:.2f} s), {written:,} bytes written besides the kernels; later start "
            f"build_parts {later['build_parts_s']:.2f} s"
        )


if __name__ == "__main__":
    main()
