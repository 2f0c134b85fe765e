"""Where a decode step's time goes, with the native decoder (every layer in one call) and op by op.

One stream of the default model (gguf weights, float16 KV) decodes at two context lengths; the two
paths alternate step by step in the same run, so a shared machine's load hits both alike. Reports the
median step time of each path, and from torch.profiler the torch ops per token and their self time.
Run: `make bench-decode` (writes benchmarks/results/decode.{json,md}).
"""

import argparse
import random
import statistics
import time
from collections import Counter
from typing import Any

from torch.profiler import ProfilerActivity, profile

from benchmarks.common import default_model, make_engine, setup_threads, write_results
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.native_decoder import NativeDecoder


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def set_path(engine: Engine, decoder: NativeDecoder | None) -> None:
    engine.runner.transformer.decoder = decoder


def step_times(engine: Engine, decoder: NativeDecoder, context: int, tokens: int) -> dict[str, float]:
    """Median ms per decode step of each path, alternating step by step on one stream."""
    engine.add_request(
        f"c{context}", prompt_ids(context, context), SamplingParams(max_tokens=tokens, ignore_eos=True)
    )
    times: dict[str, list[float]] = {"native": [], "per_op": []}
    engine.step()  # the prefill
    i = 0
    while engine.has_unfinished_requests():
        path = "native" if i % 2 == 0 else "per_op"
        set_path(engine, decoder if path == "native" else None)
        start = time.perf_counter()
        engine.step()
        times[path].append((time.perf_counter() - start) * 1000)
        i += 1
    set_path(engine, decoder)
    return {k: statistics.median(v) for k, v in times.items()}


def op_profile(engine: Engine, decoder: NativeDecoder | None, tokens: int) -> dict[str, Any]:
    """torch ops per token and their self CPU time per token, over `tokens` decode steps."""
    set_path(engine, decoder)
    engine.add_request("p", prompt_ids(27, 1), SamplingParams(max_tokens=tokens + 1, ignore_eos=True))
    engine.step()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished_requests():
            engine.step()
    wall = (time.perf_counter() - start) * 1000 / tokens
    set_path(engine, decoder)
    events = prof.key_averages()
    count = sum(e.count for e in events)
    self_ms = sum(e.self_cpu_time_total for e in events) / 1000
    top = Counter({e.key: e.self_cpu_time_total / 1000 / tokens for e in events}).most_common(6)
    return {
        "ops_per_token": count / tokens,
        "op_self_ms_per_token": self_ms / tokens,
        "profiled_ms_per_token": wall,
        "top_ops_ms_per_token": dict(top),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    threads = setup_threads()
    engine = make_engine(default_model(), threads=threads)
    decoder = engine.runner.transformer.decoder
    assert decoder is not None, "the native decoder is not available here"
    steps = {c: step_times(engine, decoder, c, args.tokens) for c in (27, 1000)}
    profiles = {"per_op": op_profile(engine, None, 16), "native": op_profile(engine, decoder, 16)}
    lines = [
        f"Decode step of one stream, default model (gguf weights, float16 KV), {threads} thread(s); "
        "the two paths alternate step by step in one run.",
        "",
        "| | op by op | native decoder | ratio |",
        "|---|---:|---:|---:|",
    ]
    for c, t in steps.items():
        ratio = t["native"] / t["per_op"]
        lines.append(
            f"| ms per step, {c}-token context | {t['per_op']:.2f} | {t['native']:.2f} | {ratio:.2f}x |"
        )
    p, n = profiles["per_op"], profiles["native"]
    lines.append(f"| torch ops per token | {p['ops_per_token']:.0f} | {n['ops_per_token']:.0f} | |")
    lines.append(
        f"| torch-op self time per token (ms, under the profiler) | {p['op_self_ms_per_token']:.2f} | "
        f"{n['op_self_ms_per_token']:.2f} | |"
    )
    for name, prof in profiles.items():
        ops = ", ".join(f"{k} {v:.2f}" for k, v in prof["top_ops_ms_per_token"].items())
        lines.append(f"\nTop torch ops by self time per token ({name}, ms): {ops}")
    write_results(
        "decode", {"threads": threads, "steps": steps, "profiles": profiles}, "\n".join(lines) + "\n"
    )


if __name__ == "__main__":
    main()
