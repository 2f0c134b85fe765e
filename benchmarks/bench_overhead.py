"""Per-token overhead of serving: a stream's inter-token latency over HTTP against the engine's own decode
step time in-process, for one stream at the same context length, in one run.

The HTTP side is a real `kvserve serve` process and a streaming client; the in-process side steps an
Engine directly. The ratio is what HTTP, the event loop and the engine thread add per token (the
target: at most 1.15x). Run: `make bench-overhead` (writes benchmarks/results/overhead.{json,md}).
"""

import argparse
import itertools
import os
import random
import statistics
import time

import httpx

from benchmarks.common import default_model, make_engine, setup_threads, start_server, write_results
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def in_process_step_ms(engine: Engine, context: int, tokens: int, seed: int) -> float:
    engine.add_request(
        f"r{seed}", prompt_ids(context, seed), SamplingParams(max_tokens=tokens, ignore_eos=True)
    )
    steps: list[float] = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        deltas = engine.step()
        if any(d.token_ids for d in deltas):
            steps.append(time.perf_counter() - start)
    # The first sampled step includes the prefill.
    return statistics.median(steps[1:]) * 1000


def http_itl_ms(url: str, context: int, tokens: int, seed: int) -> float:
    body = {"prompt": prompt_ids(context, seed), "max_tokens": tokens, "ignore_eos": True, "stream": True}
    arrivals: list[float] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter())
    # The first gap follows the prefill.
    gaps = [b - a for a, b in itertools.pairwise(arrivals[1:])]
    return statistics.median(gaps) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--context", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=8123)
    args = parser.parse_args()
    threads = setup_threads()
    flags = ["--port", str(args.port), "--kv-cache-memory", "512MiB", "--threads", str(threads)]
    server = start_server(flags)
    # The same settings as the server's.
    engine = make_engine(default_model(), kv_cache_memory=512 * 2**20, threads=threads)
    rows = []
    try:
        for i in range(args.rounds):
            # Fresh prompts each round, so neither side reads the other's prefix from a cache.
            step = in_process_step_ms(engine, args.context, args.tokens, seed=2 * i)
            itl = http_itl_ms(f"http://127.0.0.1:{args.port}", args.context, args.tokens, seed=2 * i + 1)
            rows.append({"in_process_step_ms": step, "http_itl_ms": itl, "ratio": itl / step})
    finally:
        server.terminate()
        server.wait()
    step = statistics.median(r["in_process_step_ms"] for r in rows)
    itl = statistics.median(r["http_itl_ms"] for r in rows)
    table = (
        f"One stream, {args.context}-token context, {args.tokens} tokens, {threads} threads, "
        f"median of {args.rounds} interleaved rounds.\n\n"
        "| in-process decode step (ms) | HTTP inter-token latency (ms) | ratio |\n|---:|---:|---:|\n"
        f"| {step:.1f} | {itl:.1f} | {itl / step:.2f}x |\n"
    )
    write_results("overhead", {"rounds": rows, "cpu_count": os.cpu_count()}, table)


if __name__ == "__main__":
    main()
