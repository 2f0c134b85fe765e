"""Drive engines through scripted workloads and check them against a no-cache reference, token for token.

The engines run a tiny random model in float64, where the rounding differences between batch shapes and
chunkings are far too small to flip a greedy token: any difference in output is a scheduling or cache bug.
"""

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.loader import LoadedModel
from kvserve.model.runner import ForwardBatch, ModelRunner, SequenceChunk

DTYPE = "float64"
MAX_MODEL_LEN = 512


def block_bytes(model: LoadedModel, block_size: int) -> int:
    return model.config.kv_bytes_per_token(torch.float64.itemsize) * block_size


def engine_with_blocks(model: LoadedModel, num_blocks: int, block_size: int, **overrides: Any) -> Engine:
    """An engine on `model` whose KV pool has exactly `num_blocks` blocks."""
    config = EngineConfig(
        dtype=DTYPE,
        weight_dtype="float32",
        block_size=block_size,
        kv_cache_memory=num_blocks * block_bytes(model, block_size),
        max_model_len=MAX_MODEL_LEN,
        **overrides,
    )
    engine = Engine(config, model=model)
    assert engine.num_blocks == num_blocks
    return engine


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@dataclass
class Spec:
    """One request of a workload. Its prompt is `base` (see `prompt_of`) followed by `suffix`.

    base: ("system", k) a system prompt; ("repeat", j) request j's prompt; ("follow", j) request j's
    prompt and output, as the next turn of a chat (submitted once j has ended).
    """

    base: tuple[str, int]
    suffix: list[int]
    max_tokens: int
    arrival: int = 0
    abort_after: int | None = None
    namespace: str = ""


@dataclass
class Run:
    prompts: dict[int, list[int]] = field(default_factory=dict)
    outputs: dict[int, list[int]] = field(default_factory=dict)
    aborted: set[int] = field(default_factory=set)
    max_tokens: dict[int, int] = field(default_factory=dict)


def _depends_on(spec: Spec) -> int | None:
    return spec.base[1] if spec.base[0] in ("repeat", "follow") else None


def drive(
    engine: Engine,
    systems: Sequence[list[int]],
    specs: Sequence[Spec],
    check_each_step: bool = True,
    max_steps: int = 20_000,
) -> Run:
    """Submit each spec at its arrival step (and after what it depends on), step until all end, abort
    where a spec says so; checks the cache invariants after every step."""
    run = Run()
    limit = min(engine.max_model_len, engine.request_pool_tokens)
    submitted_at: dict[int, int] = {}
    done: set[int] = set()
    pending = list(range(len(specs)))
    step = 0
    while pending or engine.has_unfinished_requests():
        for i in list(pending):
            spec = specs[i]
            dep = _depends_on(spec)
            if spec.arrival > step or (dep is not None and dep not in done):
                continue
            pending.remove(i)
            kind, k = spec.base
            if kind == "system":
                base = list(systems[k])
            elif kind == "repeat":
                base = list(run.prompts[k])
            else:
                base = run.prompts[k] + run.outputs[k]
            # Clipped so that every request fits the pool: a prompt that fills it is a case worth having.
            max_tokens = min(spec.max_tokens, limit - 1)
            prompt = (base + spec.suffix)[: limit - max_tokens] or [7]
            run.prompts[i] = prompt
            run.max_tokens[i] = max_tokens
            run.outputs[i] = []
            engine.add_request(str(i), prompt, greedy(max_tokens), spec.namespace)
            submitted_at[i] = step
        for delta in engine.step():
            i = int(delta.request_id)
            run.outputs[i] += delta.token_ids
            if delta.finished:
                done.add(i)
        for i, at in submitted_at.items():
            after = specs[i].abort_after
            if i not in done and after is not None and step - at >= after and engine.abort_request(str(i)):
                run.aborted.add(i)
                done.add(i)
        # Lower tiers write behind; waiting for them each step makes which blocks a later admission
        # finds on disk a function of the workload alone, so a failing case replays exactly.
        engine.kv.flush()
        if check_each_step:
            engine.kv.check()
        step += 1
        assert step < max_steps, "the engine stopped making progress"
    return run


def reference_outputs(reference: Engine, run: Run) -> dict[int, list[int]]:
    """Every prompt of `run` generated in one batch by a no-cache engine."""
    for i, prompt in run.prompts.items():
        reference.add_request(f"ref-{i}", prompt, greedy(run.max_tokens[i]))
    out: dict[int, list[int]] = {i: [] for i in run.prompts}
    while reference.has_unfinished_requests():
        for delta in reference.step():
            out[int(delta.request_id[4:])] += delta.token_ids
    return out


def assert_matches_reference(run: Run, expected: dict[int, list[int]]) -> None:
    for i, got in run.outputs.items():
        if i in run.aborted:
            assert got == expected[i][: len(got)], f"request {i} (aborted) diverged from the reference"
        else:
            assert got == expected[i], f"request {i} diverged from the reference"


def assert_no_leak(engine: Engine) -> None:
    assert not engine.has_unfinished_requests()
    engine.kv.check()
    usage = engine.kv.usage()
    assert usage.num_locked == 0
    assert usage.num_free + usage.num_cached == usage.num_blocks


def assert_cached_kv_is_fresh(engine: Engine, model: LoadedModel, sample: int, seed: int = 0) -> None:
    """For a sample of tree entries, the KV in the entry's block equals a fresh computation of its tokens."""
    cache = engine.kv.prefix_cache
    assert cache is not None
    entries = cache.entries()
    if not entries:
        return
    bs = engine.config.block_size
    scratch = ModelRunner(model, MAX_MODEL_LEN, 1, MAX_MODEL_LEN, "cpu", DTYPE, "float32")
    for namespace, path, block in random.Random(seed).sample(entries, min(sample, len(entries))):
        del namespace
        scratch.execute(ForwardBatch(prefills=[SequenceChunk(list(path), 0, list(range(len(path))), False)]))
        start = (len(path) - 1) // bs * bs
        n = len(path) - start
        kv = engine.runner.kv_cache
        for ours, fresh in ((kv.k, scratch.kv_cache.k), (kv.v, scratch.kv_cache.v)):
            torch.testing.assert_close(
                ours[:, block * bs : block * bs + n], fresh[:, start : start + n], atol=1e-9, rtol=1e-9
            )
