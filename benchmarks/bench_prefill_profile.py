"""Where a cold prefill's time goes, in process: one request of fresh random tokens, `max_tokens=1`, on an
engine as the server builds it (`--speculative off`), timed as process CPU time and wall time, then one
more run under cProfile, its functions' own time summed into parts (the products, the attention kernel,
the gelu, the glue...). Native calls count in the Python function that makes them, so each part is
the native kernel plus its wrapper.

Run: `python -m benchmarks.bench_prefill_profile FILE [--tokens 800] [--threads 2] [--repeats 2]`. On a
shared machine, `--threads 1` gives the steadiest split: two threads' wall time and CPU time both
inflate when the other core is busy (a waiting OpenMP thread spins).
"""

import argparse
import cProfile
import pstats
import random
import time
from typing import Any

import torch

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.quant_linear import NativeRmsNorm, QuantLinear


def _where(fn: Any) -> str:
    """How cProfile names `fn` (a method of kvserve.model.quant_linear): file, first line, name."""
    return f"quant_linear.py:{fn.__code__.co_firstlineno}({fn.__name__})"


# (part, substrings of a profiled function's "file:line(name)"), first match wins.
PARTS = (
    ("gelu (gelu_tanh_rows)", ("(gelu_tanh)",)),
    ("silu (silu_rows)", (_where(QuantLinear.silu),)),
    ("layer products and head (quant_linear)", (_where(QuantLinear._run),)),
    ("attention kernel (native paged)", ("native_attention.py",)),
    ("torch SDPA attention", ("scaled_dot_product",)),
    ("norms (rms_norm_rows)", (_where(NativeRmsNorm.__call__),)),
    ("rope", ("rope.py",)),
    ("KV write", ("index_copy_", "write_kv")),
    ("embedding rows", (_where(QuantLinear.rows),)),
)


def run(engine: Engine, rng: random.Random, tokens: int, rid: str) -> tuple[float, float]:
    """(CPU seconds of the process, wall seconds) of one fresh prompt's prefill and first token."""
    ids = [rng.randrange(1000, min(200_000, engine.limits.vocab_size)) for _ in range(tokens)]
    cpu, wall = time.process_time(), time.perf_counter()
    engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    return time.process_time() - cpu, time.perf_counter() - wall


def parts(stats: pstats.Stats) -> dict[str, float]:
    """The profile's own times summed into PARTS; the rest is "glue"."""
    totals = {name: 0.0 for name, _ in PARTS} | {"glue (other Python and torch ops)": 0.0}
    for (file, line, func), (_, _, own, _, _) in stats.stats.items():
        where = f"{file}:{line}({func})"
        name = next(
            (n for n, keys in PARTS if any(k in where for k in keys)), "glue (other Python and torch ops)"
        )
        totals[name] += own
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=800)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.from_config(EngineConfig(model=args.model, speculative="off"))
    rng = random.Random(0)
    run(engine, rng, args.tokens, "warm")
    for i in range(args.repeats):
        cpu, wall = run(engine, rng, args.tokens, f"timed-{i}")
        print(
            f"{args.tokens} tokens, {args.threads} threads: CPU {cpu * 1e3:.0f} ms, "
            f"wall {wall * 1e3:.0f} ms, {args.tokens / wall:.0f} tok/s"
        )
    profiler = cProfile.Profile()
    profiler.enable()
    run(engine, rng, args.tokens, "profiled")
    profiler.disable()
    totals = parts(pstats.Stats(profiler))
    whole = sum(totals.values())
    print(f"profiled run, the main thread's view ({whole * 1e3:.0f} ms):")
    for name, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {name:42s} {seconds * 1e3:7.0f} ms  {seconds / whole:5.1%}")


if __name__ == "__main__":
    main()
