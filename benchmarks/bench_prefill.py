"""The gguf weights' blocked product for prefill: its AVX-512 tiles against the AVX2 ones, in one run.

On the default model (gguf weights): GMAC/s of each distinct product of a layer at 512 rows, on 1 and 2
threads, and the prefill tokens/s of fresh 512- and 2,000-token prompts in process (time to the first
token of a request alone). The two kinds of tile give the same bits; `QuantLinear.wide` switches between
them, and the two alternate run by run so that a shared machine's load hits both alike. fbgemm's float16
GEMM on the same shapes is the yardstick. Where the build has no AVX-512 tiles both columns are AVX2.
Run: `make bench-prefill` (writes benchmarks/results/prefill.{json,md}).
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
PATHS = ("avx2", "avx512")


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


def set_wide(engine: Engine, wide: bool) -> None:
    for p in quant_linears(engine):
        p.wide = wide


def best_seconds(fn: Any, x: torch.Tensor, repeats: int) -> float:
    fn(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
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
                linear.wide = path == "avx512"
                row[path] = max(row.get(path, 0.0), macs / best_seconds(linear, x, 3))
        linear.wide = True
        fp16 = make_linear(linear.weight.dequantize(), None, "float16")
        row["fbgemm_float16"] = macs / best_seconds(fp16, x, 3)
        results[f"{name} {n_in}x{n_out}"] = row
    return results


def prefill_tokens_per_s(engine: Engine, tokens: int, repeats: int) -> dict[str, float]:
    rng = random.Random(tokens)
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    for i in range(repeats):
        for path in PATHS:
            set_wide(engine, path == "avx512")
            ids = [rng.randrange(100, 49000) for _ in range(tokens)]
            ttft, _, _ = timed_request(engine, f"p{tokens}-{i}-{path}", ids, SamplingParams(max_tokens=1))
            times[path].append(ttft)
    set_wide(engine, True)
    return {p: tokens / statistics.median(t) for p, t in times.items()}


def main() -> None:
    threads = setup_threads()
    engine = make_engine(default_model(), threads=threads, enable_prefix_caching=False)
    gmacs = {t: product_gmacs(engine, t) for t in (1, 2)}
    torch.set_num_threads(threads)
    prefill = {n: prefill_tokens_per_s(engine, n, 3 if n <= 512 else 2) for n in (512, 2000)}
    lines = [
        f"Blocked product of the default model's gguf weights at {ROWS} rows (GMAC/s, best of 3), "
        "AVX2 tiles against AVX-512 tiles (the same bits), fbgemm float16 as the yardstick.",
        "",
        "| product | threads | AVX2 tiles | AVX-512 tiles | fbgemm float16 |",
        "|---|---:|---:|---:|---:|",
    ]
    for t, rows in gmacs.items():
        for name, r in rows.items():
            lines.append(
                f"| {name} | {t} | {r['avx2']:.1f} | {r['avx512']:.1f} | {r['fbgemm_float16']:.1f} |"
            )
    lines += [
        "",
        f"Prefill of a fresh prompt alone, {threads} thread(s), tokens/s (median time to first token):",
        "",
        "| prompt tokens | AVX2 tiles | AVX-512 tiles | ratio |",
        "|---:|---:|---:|---:|",
    ]
    for n, r in prefill.items():
        lines.append(f"| {n} | {r['avx2']:.0f} | {r['avx512']:.0f} | {r['avx512'] / r['avx2']:.2f}x |")
    write_results(
        "prefill",
        {"threads": threads, "rows": ROWS, "gmac_per_s": gmacs, "prefill_tokens_per_s": prefill},
        "\n".join(lines) + "\n",
    )


if __name__ == "__main__":
    main()
