"""Where a hybrid model's decode step goes, op by op (the native decoder has no recurrent layers yet).

One engine on a GGUF (benchmarks/peer_models.py writes them), one thread by default; after a prompt, N
decode steps of 1 and of 4 streams, timed three ways:
- plainly: wall and thread CPU ms per step;
- attributed: the step's thread CPU time split by what runs it, each callable's time less its children's
  (wrappers on the classes, about a microsecond per call): the native block products (the layers' and,
  apart, the head's), the Gated DeltaNet's recurrence, its convolution and the rest of its layer in torch
  (gates, l2 and gated norms), LFM2's short convolution less its products, attention, the MLP less its
  products, the layers' glue (norms, rope, residuals), sampling, and the engine's own (scheduling, step
  metadata, detokenizing);
- torch.profiler: torch ops per step and their summed self time, the per-op overhead.

The thread's CPU time, on one thread, is what the step costs whatever else the machine runs: on a
shared machine, two threads' wall time is mostly waiting for a descheduled thread at each parallel
region's end.

Run: `python -m benchmarks.bench_hybrid_decode_profile FILE.gguf` (writes
benchmarks/results/hybrid-decode-<name>.{json,md}).
"""

import argparse
import os
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import RESULTS, write_results
from kvserve.config import EngineConfig, default_cache_dir
from kvserve.engine import sampler
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model import gated_deltanet, linear, mlp, moe, quant_linear, short_conv
from kvserve.model.loader import model_name

PROMPT = 64


class Attribution:
    """Exclusive thread CPU time by category: a wrapped callable's time less that of the wrapped
    callables it calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self._stack: list[float] = []  # children's time of each open call

    def wrap(self, fn: Callable[..., Any], category: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append(0.0)
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.thread_time() - start
                children = self._stack.pop()
                self.seconds[category] += elapsed - children
                self.calls[category] += 1
                if self._stack:
                    self._stack[-1] += elapsed

        return timed


@contextmanager
def patched(targets: list[tuple[Any, str, str]], attribution: Attribution) -> Iterator[None]:
    """Each (owner, attribute, category) wrapped for the block; restored after."""
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in targets]
    try:
        for owner, name, category in targets:
            setattr(owner, name, attribution.wrap(getattr(owner, name), category))
        yield
    finally:
        for owner, name, old in saved:
            if old is None:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


def targets(engine: Engine) -> list[tuple[Any, str, str]]:
    transformer = engine.runner.transformer
    head = transformer.lm_head
    return [
        # The head apart, wrapped first (an instance attribute shadows the class's for this one product).
        (head, "_run" if isinstance(head, quant_linear.QuantLinear) else "__call__", "head product"),
        (quant_linear.QuantLinear, "_run", "products (native)"),
        *((cls, "__call__", "products (torch)") for cls in (linear.Float32Linear, linear.Fp16Linear)),
        (gated_deltanet, "recurrent_step", "DeltaNet recurrent step"),
        (gated_deltanet.GatedDeltaNet, "_convolve", "DeltaNet convolution"),
        (gated_deltanet.GatedDeltaNet, "forward", "DeltaNet gates and norms"),
        (short_conv.ShortConv, "forward", "short convolution"),
        (type(transformer.attention), "forward", "attention"),
        *(
            (cls, m, "MLP or MoE, less products")
            for cls in (mlp.GatedMlp, mlp.ClampedSwiGlu, moe.SparseMoe)
            for m in ("__call__", "add")
        ),
        (type(transformer), "forward", "layer glue (norms, rope, residuals)"),
        (type(transformer), "logits", "layer glue (norms, rope, residuals)"),
        (sampler, "sample", "sampling"),
        (Engine, "step", "engine (scheduling, metadata, detokenizing)"),
    ]


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 40000) for _ in range(n)]


def start(engine: Engine, streams: int, steps: int, key: str) -> None:
    """`streams` requests past their prompts (each has 2 tokens), each with `steps` + 4 more to go."""
    tokens: Counter[str] = Counter()
    for i in range(streams):
        params = SamplingParams(max_tokens=steps + 6, temperature=0, ignore_eos=True)
        engine.add_request(f"{key}{i}", prompt_ids(PROMPT, i), params)
    while len(tokens) < streams or min(tokens.values()) < 2:
        for delta in engine.step():
            tokens[delta.request_id] += len(delta.token_ids)


def drain(engine: Engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def measure(engine: Engine, streams: int, steps: int) -> dict[str, Any]:
    start(engine, streams, steps, "plain")
    t0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        engine.step()
    plain, plain_cpu = (time.perf_counter() - t0) / steps, (time.thread_time() - c0) / steps
    drain(engine)
    attribution = Attribution()
    start(engine, streams, steps, "attributed")
    with patched(targets(engine), attribution):
        c0 = time.thread_time()
        for _ in range(steps):
            engine.step()
        attributed = (time.thread_time() - c0) / steps
    drain(engine)
    start(engine, streams, steps, "profiled")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    drain(engine)
    events = prof.key_averages()
    top = Counter({e.key: e.self_cpu_time_total / 1000 / steps for e in events}).most_common(8)
    return {
        "streams": streams,
        "ms_per_step": plain * 1000,
        "cpu_ms_per_step": plain_cpu * 1000,
        "ms_per_step_attributed": attributed * 1000,
        "attributed_ms_per_step": {k: v * 1000 / steps for k, v in attribution.seconds.items()},
        "calls_per_step": {k: v / steps for k, v in attribution.calls.items()},
        "torch_ops_per_step": sum(e.count for e in events) / steps,
        "torch_op_self_ms_per_step": sum(e.self_cpu_time_total for e in events) / 1000 / steps,
        "top_torch_ops_ms_per_step": dict(top),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", help="a GGUF file")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = EngineConfig(
        model=os.path.abspath(args.model),
        cache_dir=default_cache_dir(),
        kv_cache_memory=512 * 2**20,
        speculative="off",
    )
    engine = Engine.from_config(config)
    name = model_name(args.model)
    runs = [measure(engine, streams, args.steps) for streams in (1, 4)]
    lines = [
        f"Decode step on {name}, {args.threads} threads, op by op; {args.steps} steps after a "
        f"{PROMPT}-token prompt per stream. Exclusive thread CPU ms per step by what runs it.",
        "",
        "| | " + " | ".join(f"{r['streams']} stream(s)" for r in runs) + " |",
        "|---|" + "---:|" * len(runs),
        "| wall ms per step, unwrapped | " + " | ".join(f"{r['ms_per_step']:.1f}" for r in runs) + " |",
        "| CPU ms per step, unwrapped | " + " | ".join(f"{r['cpu_ms_per_step']:.1f}" for r in runs) + " |",
        "| CPU ms per step, wrapped | "
        + " | ".join(f"{r['ms_per_step_attributed']:.1f}" for r in runs)
        + " |",
    ]
    categories = sorted({c for r in runs for c in r["attributed_ms_per_step"]}, key=lambda c: -runs[0][
        "attributed_ms_per_step"].get(c, 0.0))  # fmt: skip
    for c in categories:
        cells = []
        for r in runs:
            ms = r["attributed_ms_per_step"].get(c, 0.0)
            cells.append(f"{ms:.2f} ({ms / r['ms_per_step_attributed']:.0%})")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines.append(
        "| torch ops per step | " + " | ".join(f"{r['torch_ops_per_step']:.0f}" for r in runs) + " |"
    )
    lines.append(
        "| torch ops' self time per step (ms, under torch.profiler) | "
        + " | ".join(f"{r['torch_op_self_ms_per_step']:.1f}" for r in runs)
        + " |"
    )
    for r in runs:
        ops = ", ".join(f"{k} {v:.2f}" for k, v in r["top_torch_ops_ms_per_step"].items())
        lines.append(f"\nTop torch ops by self ms per step, {r['streams']} stream(s): {ops}")
    write_results(f"hybrid-decode-{name}", {"model": name, "runs": runs}, "\n".join(lines) + "\n", RESULTS)


if __name__ == "__main__":
    main()
