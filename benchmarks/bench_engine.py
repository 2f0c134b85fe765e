"""kvserve's engine against Hugging Face transformers `generate`, and kvserve's weight precisions.

Same weights, same process, interleaved. Against transformers (both float32): prefill tokens/s (512 and
2048 tokens), single-stream decode tokens/s, and kvserve's aggregate decode tokens/s at batch 8 and 32.
Then the same kvserve measures for each `weight_dtype` (float32, float16, int8, q8_0 and gguf, the GGUF's
own blocks, with int16 activations by default; gguf also with `activations` float32, the exact mode), with
ratios to float32 and gguf's to float16; every mode runs the default float16 KV cache.
Run: `make bench-engine` (writes benchmarks/results/engine.{json,md}).
"""

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import (
    default_model,
    make_engine,
    median_of,
    setup_threads,
    timed_request,
    write_results,
)
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def hf_generate_time(model: Any, ids: list[int], new_tokens: int) -> float:
    x = torch.tensor([ids])
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(x, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return time.perf_counter() - start


def ours_prefill(engine: Engine, n: int, seed: int) -> float:
    ttft, _, _ = timed_request(
        engine, f"p{n}-{seed}", random_prompt(n, seed), SamplingParams(max_tokens=1, temperature=0)
    )
    return n / ttft


def ours_decode(engine: Engine, new_tokens: int, seed: int) -> float:
    ttft, total, n = timed_request(
        engine,
        f"d{seed}",
        random_prompt(32, seed),
        SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True),
    )
    return (n - 1) / (total - ttft)


def ours_batch_decode(engine: Engine, batch: int, new_tokens: int, seed: int) -> float:
    """Aggregate decode tokens/s once every request of the batch is decoding."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{seed}-{i}", random_prompt(32, seed * 100 + i), params)
    started: set[str] = set()
    decode_start = None
    tokens = 0
    while engine.has_unfinished_requests():
        deltas = engine.step()
        if decode_start is not None:
            tokens += len(deltas)
        started |= {d.request_id for d in deltas}
        if decode_start is None and len(started) == batch:
            decode_start = time.perf_counter()
    assert decode_start is not None
    return tokens / (time.perf_counter() - decode_start)


# Each mode's engine settings: the weight dtypes, and gguf's float32 activations beside its int16 default.
MODES: dict[str, dict[str, str]] = {
    **{d: {"weight_dtype": d} for d in ("float32", "float16", "int8", "q8_0", "gguf")},
    "gguf, float32 activations": {"weight_dtype": "gguf", "activations": "float32"},
}


def weight_dtype_table(
    engines: dict[str, Engine], repeats: int, new_tokens: int
) -> tuple[dict[str, Any], list[str]]:
    """Each measure, each repeat, runs every mode on the same prompts one after another."""
    measures: dict[str, Callable[[Engine, int], float]] = {
        "prefill 512 tokens (tok/s)": lambda e, seed: ours_prefill(e, 512, seed),
        "decode, 1 stream (tok/s)": lambda e, seed: ours_decode(e, new_tokens, seed),
        "decode, batch 8 aggregate (tok/s)": lambda e, seed: ours_batch_decode(e, 8, new_tokens, seed),
        "decode, batch 32 aggregate (tok/s)": lambda e, seed: ours_batch_decode(e, 32, new_tokens, seed),
    }
    samples: dict[tuple[str, str], list[float]] = {(n, m): [] for n in measures for m in engines}
    for _ in range(repeats):
        for name, measure in measures.items():
            seed = random.randrange(10**6)
            for mode, engine in engines.items():
                samples[name, mode].append(measure(engine, seed))
    results: dict[str, Any] = {}
    others = [m for m in engines if m != "float32"]
    lines = [
        "| measure | "
        + " | ".join(engines)
        + " | "
        + " | ".join(f"{m} / float32" for m in others)
        + " | gguf / float16 |",
        "|---|" + "---:|" * (len(engines) + len(others) + 1),
    ]
    for name in measures:
        med = {m: statistics.median(samples[name, m]) for m in engines}
        results[name] = {m: {"tok_s": med[m], "vs_float32": med[m] / med["float32"]} for m in engines}
        results[name]["gguf"]["vs_float16"] = med["gguf"] / med["float16"]
        lines.append(
            f"| {name} | "
            + " | ".join(f"{med[m]:.1f}" for m in engines)
            + " | "
            + " | ".join(f"{med[m] / med['float32']:.2f}x" for m in others)
            + f" | {med['gguf'] / med['float16']:.2f}x |"
        )
    return results, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    args = parser.parse_args()
    threads = setup_threads()
    import transformers

    model = default_model()
    engines = {
        mode: make_engine(
            model,
            **settings,
            enable_prefix_caching=False,
            max_num_batched_tokens=2048,
            kv_cache_memory=512 * 2**20,
        )
        for mode, settings in MODES.items()
    }
    for warm in engines.values():
        ours_prefill(warm, 64, 0)
    # Against transformers, which runs float32 weights: kvserve's float32 weights too.
    engine = engines["float32"]
    folder, name = os.path.split(model.path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    hf_generate_time(hf, random_prompt(64, 0), 2)

    results: dict[str, Any] = {"threads": threads, "model": model.name, "repeats": args.repeats}
    rows = []
    for n in (512, 2048):
        ours = median_of(lambda n=n: ours_prefill(engine, n, random.randrange(10**6)), args.repeats)
        theirs = median_of(
            lambda n=n: n / hf_generate_time(hf, random_prompt(n, random.randrange(10**6)), 1), args.repeats
        )
        results[f"prefill_{n}"] = {
            "kvserve_tok_s": ours,
            "transformers_tok_s": theirs,
            "ratio": ours / theirs,
        }
        rows.append((f"prefill {n} tokens (tok/s)", ours, theirs))

    new = args.decode_tokens

    def hf_decode() -> float:
        ids = random_prompt(32, random.randrange(10**6))
        return (new - 1) / (hf_generate_time(hf, ids, new) - hf_generate_time(hf, ids, 1))

    ours_single = median_of(lambda: ours_decode(engine, new, random.randrange(10**6)), args.repeats)
    theirs_single = median_of(hf_decode, args.repeats)
    results["decode_single"] = {
        "kvserve_tok_s": ours_single,
        "transformers_tok_s": theirs_single,
        "ratio": ours_single / theirs_single,
    }
    rows.append(("decode, 1 stream (tok/s)", ours_single, theirs_single))
    for batch in (8, 32):
        agg = median_of(
            lambda b=batch: ours_batch_decode(engine, b, new, random.randrange(10**6)), args.repeats
        )
        results[f"decode_batch_{batch}"] = {"kvserve_tok_s": agg, "vs_single_stream": agg / ours_single}
        rows.append((f"decode, batch {batch} aggregate (tok/s)", agg, None))

    lines = [
        f"Engine vs transformers {transformers.__version__} `generate`, {model.name}, float32, "
        f"{threads} threads, "
        f"median of {args.repeats}.",
        "",
        "| measure | kvserve | transformers | ratio |",
        "|---|---:|---:|---:|",
    ]
    for name, ours, theirs in rows:
        ratio = f"{ours / theirs:.2f}x" if theirs else f"{ours / ours_single:.1f}x single stream"
        lines.append(f"| {name} | {ours:.1f} | {theirs:.1f} |" if theirs else f"| {name} | {ours:.1f} | - |")
        lines[-1] += f" {ratio} |"

    results["weight_dtype"], mode_lines = weight_dtype_table(engines, args.repeats, new)
    lines += [
        "",
        f"kvserve by `weight_dtype`, {model.name}, {threads} threads, {new} decoded tokens per request, "
        f"median of {args.repeats}, modes interleaved on the same prompts.",
        "",
        *mode_lines,
    ]
    write_results("engine", results, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
