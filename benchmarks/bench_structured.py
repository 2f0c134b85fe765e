"""What structured outputs cost: compiling a real JSON schema, the token mask per step, and a decode step
of a batch of 8 constrained requests against 8 unconstrained ones, on the default model, in one run.

Two views of the batch: the sampler alone (8 rows of logits, with and without 8 grammar states that
follow a real document), which isolates what constraints add to a step, and whole engine steps, with
unconstrained and constrained batches alternating so that load on the machine hits both alike (the
fastest run of each is compared: load only adds time). Run:
`make bench-structured` (writes benchmarks/results/structured.{json,md}).
"""

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

from benchmarks.common import default_model, make_engine, setup_threads, write_results
from kvserve.engine import sampler
from kvserve.engine.engine import Engine
from kvserve.engine.grammar import GrammarCompiler, StructuredOutputs
from kvserve.engine.request import Request
from kvserve.engine.sampling_params import SamplingParams

# A real-world shape: nested objects, $defs/$ref, bounded arrays, enums, ranges, anyOf, formats.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "$defs": {
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 40},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "zip"],
        }
    },
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "vip", "new"]}, "minItems": 1, "maxItems": 4},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "address": {"$ref": "#/$defs/address"},
        "contact": {
            "anyOf": [{"type": "string"}, {"type": "object", "properties": {"phone": {"type": "string"}}}]
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "active"],
}
DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.com",
    "tags": ["vip", "new"],
    "score": 0.75,
    "address": {"street": "12 St James Square", "zip": "10001"},
    "contact": {"phone": "555"},
    "active": True,
}
# For the batch: long notes keep every constrained request decoding as long as the unconstrained ones.
LONG = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string", "minLength": 40}, "minItems": 8}},
    "required": ["notes"],
}


def compile_ms(compiler: GrammarCompiler, repeats: int) -> tuple[float, float]:
    """Median milliseconds of a cold compile (a schema not seen before) and of a cached one."""
    cold = []
    for i in range(repeats):
        spec = StructuredOutputs(json={**SCHEMA, "description": f"variant {i} {random.random()}"})
        start = time.perf_counter()
        compiler.compile(spec)
        cold.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(100):
        compiler.compile(spec)
    return statistics.median(cold) * 1000, (time.perf_counter() - start) * 10


def mask_us_per_token(engine: Engine, compiler: GrammarCompiler) -> float:
    """Median microseconds to compute one token's mask while following DOCUMENT's tokens."""
    import llguidance.torch

    ids = engine.tokenizer.encode(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False)
    state = compiler.compile(StructuredOutputs(json=SCHEMA)).start()
    bitmask = llguidance.torch.allocate_token_bitmask(1, compiler.vocab_size)
    times = []
    for token in ids:
        start = time.perf_counter()
        state.fill_bitmask(bitmask, 0)
        times.append(time.perf_counter() - start)
        assert state.accept(token), state.error
    return statistics.median(times) * 1e6


def sampler_ms(engine: Engine, compiler: GrammarCompiler, batch: int, constrained: bool) -> float:
    """Median milliseconds of one sampler call over `batch` rows, each row's grammar state (if any)
    following DOCUMENT's tokens."""
    ids = engine.tokenizer.encode(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False)
    compiled = compiler.compile(StructuredOutputs(json=SCHEMA))
    params = SamplingParams(temperature=0.0)
    requests = [
        Request(str(i), [1, 2, 3], params, len(ids), None, grammar=compiled.start() if constrained else None)  # type: ignore[arg-type]
        for i in range(batch)
    ]
    logits = torch.randn(batch, engine.model.config.vocab_size)
    times = []
    for token in ids:
        start = time.perf_counter()
        sampler.sample(logits, requests, engine.tokenizer.eos_token_ids)
        times.append(time.perf_counter() - start)
        for r in requests:
            r.token_ids.append(token)
            if r.grammar is not None:
                assert r.grammar.accept(token), r.grammar.error
    return statistics.median(times) * 1000


def batch_step_ms(engine: Engine, constrained: bool, batch: int, tokens: int, seed: int) -> float:
    """Median decode-step time while all `batch` requests decode."""
    rng = random.Random(seed)
    so = StructuredOutputs(json=LONG) if constrained else None
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, structured_outputs=so)
    for i in range(batch):
        prompt = [rng.randrange(100, 49000) for _ in range(64)]
        (checked,) = engine.validate_request([prompt], params)
        engine.add_request(f"{seed}-{i}", checked, params)
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        deltas = engine.step()
        elapsed = time.perf_counter() - start
        if sum(1 for d in deltas if d.token_ids) == batch:
            steps.append(elapsed)
    # The first full step follows the prefills.
    return statistics.median(steps[1:]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--compiles", type=int, default=10)
    args = parser.parse_args()
    threads = setup_threads()
    engine = make_engine(default_model(), kv_cache_memory=256 * 2**20)
    compiler = engine.grammars
    compiler.compile(StructuredOutputs(regex="warm"))  # builds the library's view of the tokenizer
    cold, warm = compile_ms(compiler, args.compiles)
    mask = mask_us_per_token(engine, compiler)
    sample_plain = statistics.median(sampler_ms(engine, compiler, args.batch, False) for _ in range(3))
    sample_constrained = statistics.median(sampler_ms(engine, compiler, args.batch, True) for _ in range(3))
    added = sample_constrained - sample_plain
    plain, constrained = [], []
    for r in range(args.rounds):
        plain.append(batch_step_ms(engine, False, args.batch, args.tokens, 2 * r))
        constrained.append(batch_step_ms(engine, True, args.batch, args.tokens, 2 * r + 1))
    # The fastest run of each: on a shared machine, load only ever adds time.
    plain_ms, constrained_ms = min(plain), min(constrained)
    results = {
        "threads": threads,
        "schema_compile_ms": cold,
        "cached_compile_ms": warm,
        "mask_us_per_token": mask,
        "batch": args.batch,
        "sampler_plain_ms": sample_plain,
        "sampler_constrained_ms": sample_constrained,
        "added_per_step_ms": added,
        "added_vs_plain_step": added / plain_ms,
        "plain_step_ms": plain_ms,
        "constrained_step_ms": constrained_ms,
        "ratio": constrained_ms / plain_ms,
        "plain_runs_ms": plain,
        "constrained_runs_ms": constrained,
    }
    table = (
        "| measure | value |\n|---|---|\n"
        f"| compile a real JSON schema (cold, median of {args.compiles}) | {cold:.1f} ms |\n"
        f"| the same schema from the cache | {warm:.3f} ms |\n"
        f"| token mask, one request, per token | {mask:.0f} us |\n"
        f"| sampler, {args.batch} unconstrained rows | {sample_plain:.2f} ms |\n"
        f"| sampler, {args.batch} constrained rows (masks included) | {sample_constrained:.2f} ms |\n"
        f"| added per step by {args.batch} constraints | {added:.2f} ms ({added / plain_ms:.1%} of one) |\n"
        f"| decode step, {args.batch} unconstrained requests (fastest run) | {plain_ms:.1f} ms |\n"
        f"| decode step, {args.batch} constrained requests (fastest run) | {constrained_ms:.1f} ms |\n"
        f"| constrained / unconstrained | {constrained_ms / plain_ms:.3f}x |\n"
    )
    write_results("structured", results, table)
    print(table)


if __name__ == "__main__":
    main()
