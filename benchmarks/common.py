"""Shared pieces of the benchmark scripts: timing, the engines under test, and writing results."""

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import torch

from kvserve.config import EngineConfig, default_cache_dir
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.loader import LoadedModel, load_model

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def start_server(flags: Sequence[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A `kvserve serve` process with `flags` (which name its --port), once its /health answers; its
    output is dropped. `env` replaces the environment (another checkout's PYTHONPATH)."""
    port = flags[list(flags).index("--port") + 1]
    argv = [sys.executable, "-m", "kvserve", "serve", *flags]
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"kvserve serve {' '.join(flags)} did not start")
        time.sleep(0.2)


def status_bytes(pid: int, field: str) -> int:
    """A size in the process's /proc status (VmRSS, VmHWM), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith(f"{field}:"))
    return int(line.split()[1]) * 1024


def setup_threads() -> int:
    threads = int(os.environ.get("KVSERVE_BENCH_THREADS", "2"))
    torch.set_num_threads(threads)
    return threads


def default_model() -> LoadedModel:
    return load_model(None, default_cache_dir())


def make_engine(model: LoadedModel, **overrides: Any) -> Engine:
    return Engine.from_config(EngineConfig(**overrides), model=model)


def timed_request(
    engine: Engine, rid: str, ids: list[int], params: SamplingParams
) -> tuple[float, float, int]:
    """Run one request alone: (time to first token, total time, tokens generated)."""
    start = time.perf_counter()
    engine.add_request(rid, ids, params)
    first = None
    n = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            n += len(delta.token_ids)
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - start, end - start, n


def median_of(fn: Callable[[], float], repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def write_results(name: str, results: dict[str, Any], table: str, folder: str = RESULTS) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{name}.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(folder, f"{name}.md"), "w") as f:
        f.write(table)
    print(table)
