"""Decode step time with the native attention kernel against the portable torch path, in one run.

In-process, default weights: one stream decoding at several context lengths, and a batch of 8 streams of
mixed context lengths (where the portable path pads every decode to the longest). The two engines
alternate step by step on identical requests, so load on a shared machine hits both alike; the table
reports median wall and CPU time per decode step and the ratio. Run: `make bench-attention` (writes
benchmarks/results/attention.{json,md}). `--compare kv-dtypes` runs the native kernel over a float16
and a q8_0 KV cache instead (writes benchmarks/results/attention-kv.{json,md}).
"""

import argparse
import random
import statistics
import time
from typing import Any

from benchmarks.common import default_model, make_engine, setup_threads, write_results
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams

# What each comparison runs side by side: its engines' names and EngineConfig overrides, the first the
# baseline.
COMPARISONS: dict[str, dict[str, dict[str, Any]]] = {
    "backends": {
        "native": {"attention": "native", "kv_cache_memory": 2 * 2**30},
        "torch": {"attention": "torch", "kv_cache_memory": 2 * 2**30},
    },
    "kv-dtypes": {
        "float16": {"attention": "native", "kv_dtype": "float16", "kv_cache_memory": 512 * 2**20},
        "q8_0": {"attention": "native", "kv_dtype": "q8_0", "kv_cache_memory": 512 * 2**20},
    },
}


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def decode_steps(engines: dict[str, Engine], contexts: list[int], tokens: int) -> dict[str, list[float]]:
    """(wall ms, cpu ms) samples per backend of the steps in which every request decodes."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    seed = random.randrange(10**6)
    for engine in engines.values():
        for i, n in enumerate(contexts):
            engine.add_request(f"{seed}-{i}", prompt(n, seed + i), params)
    samples: dict[str, list[float]] = {f"{b} {kind}": [] for b in engines for kind in ("wall", "cpu")}
    started: dict[str, set[str]] = {name: set() for name in engines}
    while any(e.has_unfinished_requests() for e in engines.values()):
        for name, engine in engines.items():
            if not engine.has_unfinished_requests():
                continue
            # A step counts once every request has its first token: it then holds no prefill.
            all_decoding = len(started[name]) == len(contexts)
            wall, cpu = time.perf_counter(), time.process_time()
            deltas = engine.step()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            started[name] |= {d.request_id for d in deltas if d.token_ids}
            if all_decoding and len(deltas) == len(contexts):
                samples[f"{name} wall"].append(wall * 1000)
                samples[f"{name} cpu"].append(cpu * 1000)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--compare", choices=sorted(COMPARISONS), default="backends")
    parser.add_argument(
        "--max-context", type=int, default=None, help="skip workloads with a longer context (a short run)"
    )
    args = parser.parse_args()
    threads = setup_threads()
    model = default_model()
    engines = {
        name: make_engine(model, max_num_batched_tokens=2048, **overrides)
        for name, overrides in COMPARISONS[args.compare].items()
    }
    a, b = engines
    workloads = {
        "1 stream, 500-token context": [500],
        "1 stream, 2,000-token context": [2000],
        "1 stream, 6,000-token context": [6000],
        "8 streams, contexts 200..2,000": [200, 450, 700, 950, 1200, 1450, 1700, 2000],
    }
    results: dict[str, Any] = {"threads": threads, "model": model.name, "decode_tokens": args.tokens}
    lines = [
        f"| workload | {a} ms/step | {b} ms/step | {b} / {a} | {a} CPU ms | {b} CPU ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, contexts in workloads.items():
        if args.max_context is not None and max(contexts) > args.max_context:
            continue
        samples = decode_steps(engines, contexts, args.tokens)
        med = {k: statistics.median(v) for k, v in samples.items()}
        results[name] = med
        ratio = med[f"{b} wall"] / med[f"{a} wall"]
        lines.append(
            f"| {name} | {med[f'{a} wall']:.1f} | {med[f'{b} wall']:.1f} | {ratio:.2f}x "
            f"| {med[f'{a} cpu']:.1f} | {med[f'{b} cpu']:.1f} |"
        )
    what = (
        "Decode attention backends"
        if args.compare == "backends"
        else "Decode over a float16 and a q8_0 KV cache"
    )
    write_results(
        "attention" if args.compare == "backends" else "attention-kv",
        results,
        f"{what}, {threads} threads\n\n" + "\n".join(lines) + "\n",
    )


if __name__ == "__main__":
    main()
