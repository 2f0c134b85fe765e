"""One decode row through every matrix of a GGUF, at the file's real shapes and types, read in place.

For each weight matrix of the file (the head included), one float32 row through its native product, three
ways: int16 activations (the default) on the build's own tiles, int16 on the AVX2 tiles (`wide=False`), and
float32 activations (the exact mode, the row tile where the type takes it); one way through every matrix,
then the next, the order rotating, so that a shared machine's load hits each alike and every matrix comes
from memory. Times are the calling thread's CPU time (one thread by
default: a busy machine deschedules the thread, which wall time would count), the median per matrix kind.
Reports each kind's time, GB/s of its blocks and the ratios to the default, and a decode step's products
summed (each kind times its count).

With `--rows 1,2,4,...`: instead, batches of each size through every layer matrix (the head left out: a
step's rows reach it only for their logits), int16 against float32 activations, the two alternating and
the batch sizes rotating; reports the median over `--reps` of each mode's sum over the layers, and the
ratio (where int16 loses, the row counts a tile choice must still cover).

Run: `python -m benchmarks.bench_row_products /tmp/bench_models/gemma3-270m.gguf [--threads 1] [--reps
10] [--rows 1,2,3,4,8]` (write the file with `python -m benchmarks.peer_models gemma3-270m
/tmp/bench_models/gemma3-270m.gguf`).
"""

import argparse
import statistics
import time
from dataclasses import dataclass, field

import torch

from kvserve.config import default_cache_dir
from kvserve.model.gguf_file import F32, open_gguf
from kvserve.model.quant_blocks import QuantizedWeight, type_name
from kvserve.model.quant_linear import QuantLinear

PATHS = ("int16", "int16 AVX2 tiles", "float32")


@dataclass
class Kind:
    """The matrices of one name (without the layer) and type: their products on both paths."""

    name: str
    qtype: int
    shape: tuple[int, int]
    nbytes: int
    products: list[tuple[QuantLinear, ...]] = field(default_factory=list)
    times: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PATHS})


def kinds(path: str) -> list[Kind]:
    """Every matrix, by kind. An experts' tensor [experts, out, in] counts as its first experts, as many as
    a token uses (the file's `expert_used_count`): the step's expert reads."""
    g = open_gguf(path)
    arch = g.value("general.architecture")
    used = g.value(f"{arch}.expert_used_count") or 1
    found: dict[tuple[str, int, tuple[int, int]], Kind] = {}
    cache = default_cache_dir()
    for t in g.tensors.values():
        if t.qtype == F32 or len(t.shape) not in (2, 3):
            continue
        n_out, n_in = t.shape[-2:]
        data = torch.from_numpy(g.array(t))
        matrices = list(data[:used]) if len(t.shape) == 3 else [data.reshape(n_out, -1)]
        name = t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name
        for matrix in matrices:
            w = QuantizedWeight(t.qtype, matrix, n_in)
            kind = found.setdefault(
                (name, t.qtype, (n_out, n_in)), Kind(name, t.qtype, (n_out, n_in), w.data.numel())
            )
            kind.products.append(
                (
                    QuantLinear(w, None, cache, int16=True),
                    QuantLinear(w, None, cache, int16=True, wide=False),
                    QuantLinear(w, None, cache),
                )
            )
    return list(found.values())


def measure(all_kinds: list[Kind], reps: int) -> None:
    """Each path through every matrix in turn, the path that goes first alternating: a matrix is read
    again only after all the others (more than the last-level cache), so from memory as in a step."""
    gen = torch.Generator().manual_seed(0)
    for rep in range(reps):
        for i in [(rep + j) % len(PATHS) for j in range(len(PATHS))]:
            for kind in all_kinds:
                x = torch.randn(1, kind.shape[1], generator=gen)
                for pair in kind.products:
                    start = time.thread_time()
                    pair[i](x)
                    kind.times[PATHS[i]].append(time.thread_time() - start)


def report(all_kinds: list[Kind]) -> None:
    step = dict.fromkeys(PATHS, 0.0)
    print(f"{'matrix':24s} {'type':6s} {'shape':>13s}  n   int16 us  GB/s  AVX2 x  float32 x")
    for k in all_kinds:
        us = {p: statistics.median(k.times[p]) * 1e6 for p in PATHS}
        for p in PATHS:
            step[p] += us[p] * len(k.products)
        shape = f"{k.shape[0]}x{k.shape[1]}"
        print(
            f"{k.name:24s} {type_name(k.qtype):6s} {shape:>13s} {len(k.products):2d} {us[PATHS[0]]:10.1f} "
            f"{k.nbytes / us[PATHS[0]] / 1e3:5.1f} {us[PATHS[1]] / us[PATHS[0]]:7.2f} "
            f"{us[PATHS[2]] / us[PATHS[0]]:9.2f}"
        )
    ms = {p: step[p] / 1e3 for p in PATHS}
    print(
        f"a decode step's products: int16 {ms[PATHS[0]]:.2f} ms, int16 AVX2 tiles {ms[PATHS[1]]:.2f} ms, "
        f"float32 {ms[PATHS[2]]:.2f} ms ({ms[PATHS[2]] / ms[PATHS[0]]:.2f}x)"
    )


def measure_rows(all_kinds: list[Kind], counts: list[int], reps: int) -> None:
    """The layers' products at each batch size, int16 (the build's tiles) against float32."""
    layers = [k for k in all_kinds if len(k.products) > 1]
    gen = torch.Generator().manual_seed(0)
    times: dict[tuple[int, int], list[float]] = {(n, i): [] for n in counts for i in (0, 2)}
    for rep in range(reps):
        for n in counts[rep % len(counts) :] + counts[: rep % len(counts)]:
            for i in (0, 2) if (rep + n) % 2 else (2, 0):
                total = 0.0
                for kind in layers:
                    x = torch.randn(n, kind.shape[1], generator=gen)
                    for products in kind.products:
                        start = time.thread_time()
                        products[i](x)
                        total += time.thread_time() - start
                times[n, i].append(total)
    print(f"{'rows':>4s} {'int16 ms':>9s} {'float32 ms':>10s} {'int16 / float32':>15s}")
    for n in counts:
        int16, float32 = (statistics.median(times[n, i]) * 1e3 for i in (0, 2))
        print(f"{n:4d} {int16:9.2f} {float32:10.2f} {int16 / float32:15.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("gguf")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--rows", help="batch sizes, comma-separated: the layers' products per batch size")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    all_kinds = kinds(args.gguf)
    if args.rows:
        measure_rows(all_kinds, [int(n) for n in args.rows.split(",")], args.reps)
        return
    measure(all_kinds, args.reps)
    report(all_kinds)


if __name__ == "__main__":
    main()
