"""What a decode step costs by its row count: one sequence with 0 to N - 1 draft rows (N rows in all) at a
300-token context, in process, each count's fastest of `--reps` rounds (the counts alternating within a
round, so a shared machine's load hits each alike). A draft row runs every layer as a decode row does, so
this is the step of N decoding sequences less their separate contexts: where the products change tiles
(`Q16_GROUP_MIN`, `Q16_FEW_ROWS` in model/kernels/quants.h), the times show it.

Run: `python -m benchmarks.bench_step_rows [--model FILE.gguf] [--rows 1-17] [--reps 5]` (the default model
without --model); prints one line per row count. Never part of `make test`.
"""

import argparse
import time

from kvserve.config import EngineConfig, default_cache_dir
from kvserve.engine.cost_probe import timed_step
from kvserve.engine.engine import Engine

CONTEXT = 300


def step_times(engine: Engine, counts: list[int], reps: int) -> dict[int, float]:
    """Each row count's fastest step, in seconds."""
    vocab = engine.runner.transformer.config.vocab_size
    best: dict[int, float] = {}
    for _ in range(reps):
        for n in counts:
            seconds = timed_step(engine.runner, engine.kv, time.perf_counter, 1, n - 1, CONTEXT, vocab)
            best[n] = min(best.get(n, seconds), seconds)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="a GGUF or model folder (default: the default model)")
    parser.add_argument("--rows", default="1-17", help="row counts, FIRST-LAST (default %(default)s)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    first, last = (int(v) for v in args.rows.split("-"))
    model = {} if args.model is None else {"model": args.model}
    config = EngineConfig(
        cache_dir=default_cache_dir(), kv_cache_memory=360 * 2**20, speculative="off", **model
    )
    times = step_times(Engine.from_config(config), list(range(first, last + 1)), args.reps)
    lone = times[min(times)]
    for n, seconds in sorted(times.items()):
        print(f"{n:3d} rows: {seconds * 1000:7.2f} ms, {seconds / lone:.2f}x the fewest")


if __name__ == "__main__":
    main()
