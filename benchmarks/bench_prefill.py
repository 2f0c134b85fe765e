"""The gguf weights' blocked product for prefill: int16 activations (the default) against float32 ones
(the exact mode), each on its AVX-512 tiles and its AVX2 ones, in one run.

On the default model (gguf weights): GMAC/s of each distinct product of a layer at 512 rows, on 1 and 2
threads (1 thread: the thread's CPU time, which a shared machine's load does not inflate), and the prefill
tokens/s of fresh 512- and 2,000-token prompts in process (time to the first token of a request alone) in
each activation mode. The two kinds of tile give the same bits; `QuantLinear.wide` switches between them,
`QuantLinear.int16` between the modes, and the paths alternate run by run so that a shared machine's load
hits them alike. fbgemm's float16 GEMM on the same shapes is the yardstick. Where the build has no
AVX-512 tiles the AVX-512 columns are AVX2. Run: `make bench-prefill` (writes
benchmarks/results/prefill.{json,md}).
"""

import random
import statistics
import time
from typing import Any

import torch

from benchmarks.common import default_model, make_engine, setup_threads, timed_request, write_results
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.linear import make_linear
from kvserve.model.quant_linear import QuantLinear

ROWS = 512
# (activations, tiles): int16 or float32 activations, on the AVX-512 tiles or the AVX2 ones.
PATHS = ("int16 avx512", "int16 avx2", "float32 avx512", "float32 avx2")
MODES = ("int16", "float32")


def quant_linears(engine: Engine) -> list[QuantLinear]:
    transformer = engine.runner.transformer
    found = [
        p
        for layer in transformer.layers
        for p in (layer.qkv, layer.o, layer.gate, layer.up, layer.down)
        if isinstance(p, QuantLinear)
    ]
    if isinstance(transformer.lm_head, QuantLinear):
        found.append(transformer.lm_head)
    return found


def set_path(linear: QuantLinear, path: str) -> None:
    linear.int16 = path.startswith("int16")
    linear.wide = path.endswith("avx512")


def set_mode(engine: Engine, mode: str) -> None:
    for p in quant_linears(engine):
        set_path(p, f"{mode} avx512")


def best_seconds(fn: Any, x: torch.Tensor, repeats: int, threads: int) -> float:
    """The best of `repeats` runs: the calling thread's CPU time on one thread, else wall time."""
    clock = time.thread_time if threads == 1 else time.perf_counter
    fn(x)
    times = []
    for _ in range(repeats):
        start = clock()
        fn(x)
        times.append(clock() - start)
    return min(times)


def product_gmacs(engine: Engine, threads: int) -> dict[str, dict[str, float]]:
    """GMAC/s of each distinct product of the first layer at ROWS rows, each path and fbgemm float16."""
    torch.set_num_threads(threads)
    layer = engine.runner.transformer.layers[0]
    results: dict[str, dict[str, float]] = {}
    for name in ("qkv", "o", "gate", "up", "down"):
        linear = getattr(layer, name)
        assert isinstance(linear, QuantLinear), "the default model's products are not gguf blocks here"
        n_out, n_in = linear.weight.out_features, linear.weight.in_features
        x = torch.randn(ROWS, n_in)
        macs = ROWS * n_in * n_out / 1e9
        row: dict[str, float] = {}
        for _ in range(2):
            for path in PATHS:
                set_path(linear, path)
                row[path] = max(row.get(path, 0.0), macs / best_seconds(linear, x, 3, threads))
        set_path(linear, "int16 avx512")
        fp16 = make_linear(linear.weight.dequantize(), None, "float16")
        row["fbgemm_float16"] = macs / best_seconds(fp16, x, 3, threads)
        results[f"{name} {n_in}x{n_out}"] = row
    return results


def prefill_tokens_per_s(engine: Engine, tokens: int, repeats: int, threads: int) -> dict[str, float]:
    """Tokens/s of a fresh prompt alone in each mode: on one thread by the process's CPU time (a loaded
    machine's other work does not count), else by the time to the first token."""
    rng = random.Random(tokens)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(repeats):
        for mode in MODES:
            set_mode(engine, mode)
            ids = [rng.randrange(100, 49000) for _ in range(tokens)]
            cpu = time.process_time()
            ttft, _, _ = timed_request(engine, f"p{tokens}-{i}-{mode}", ids, SamplingParams(max_tokens=1))
            times[mode].append(time.process_time() - cpu if threads == 1 else ttft)
    set_mode(engine, "int16")
    return {m: tokens / statistics.median(t) for m, t in times.items()}


def main() -> None:
    threads = setup_threads()
    engine = make_engine(default_model(), threads=threads, enable_prefix_caching=False)
    gmacs = {t: product_gmacs(engine, t) for t in (1, 2)}
    torch.set_num_threads(threads)
    prefill = {n: prefill_tokens_per_s(engine, n, 3 if n <= 512 else 2, threads) for n in (512, 2000)}
    lines = [
        f"Blocked product of the default model's gguf weights at {ROWS} rows (GMAC/s, best of 3), int16 "
        "and float32 activations on the AVX-512 and AVX2 tiles (each mode's two the same bits), fbgemm "
        "float16 as the yardstick.",
        "",
        "| product | threads | " + " | ".join(PATHS) + " | fbgemm float16 |",
        "|---|---:|" + "---:|" * (len(PATHS) + 1),
    ]
    for t, rows in gmacs.items():
        for name, r in rows.items():
            cells = " | ".join(f"{r[p]:.1f}" for p in (*PATHS, "fbgemm_float16"))
            lines.append(f"| {name} | {t} | {cells} |")
    lines += [
        "",
        f"Prefill of a fresh prompt alone, {threads} thread(s), tokens/s (median "
        + ("CPU time" if threads == 1 else "time to first token")
        + "):",
        "",
        "| prompt tokens | int16 | float32 | ratio |",
        "|---:|---:|---:|---:|",
    ]
    for n, r in prefill.items():
        lines.append(f"| {n} | {r['int16']:.0f} | {r['float32']:.0f} | {r['int16'] / r['float32']:.2f}x |")
    write_results(
        "prefill",
        {"threads": threads, "rows": ROWS, "gmac_per_s": gmacs, "prefill_tokens_per_s": prefill},
        "\n".join(lines) + "\n",
    )


if __name__ == "__main__":
    main()
