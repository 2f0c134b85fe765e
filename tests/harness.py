"""Drive engines through scripted workloads and check them against a no-cache reference, token for token.

The engines run a tiny random model in float64, where the rounding differences between batch shapes and
chunkings are far too small to flip a greedy token: any difference in output is a scheduling or cache bug.
"""

import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.factory import state_slots
from kvserve.engine.grammar import StructuredOutputs
from kvserve.engine.outputs import RequestDelta
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.kv_quant import kv_bytes_per_token
from kvserve.model.loader import LoadedModel
from kvserve.model.runner import ForwardBatch, ModelRunner, SequenceChunk, StepLogits

DTYPE = "float64"
MAX_MODEL_LEN = 512


def block_bytes(model: LoadedModel, block_size: int, kv_dtype: str = DTYPE) -> int:
    return kv_bytes_per_token(model.config, kv_dtype) * block_size


def engine_with_blocks(model: LoadedModel, num_blocks: int, block_size: int, **overrides: Any) -> Engine:
    """An engine on `model` whose KV pool has exactly `num_blocks` blocks (at least, with a sliding
    pool of its own); a `kv_dtype` override (q8_0) sizes the pool in its bytes. float64 and float32
    weights unless `dtype` and `weight_dtype` say otherwise."""
    settings = {"dtype": DTYPE, "weight_dtype": "float32", **overrides}
    # The pool's dtype as the config resolves it ("auto": float16 under float32 compute).
    kv_dtype = EngineConfig(**settings).kv_cache_dtype
    config = EngineConfig(
        block_size=block_size,
        kv_cache_memory=num_blocks * block_bytes(model, block_size, kv_dtype),
        max_model_len=MAX_MODEL_LEN,
        **settings,
    )
    # A hybrid model's recurrent states come out of the same memory: add theirs (as asked: they then fit).
    unbounded = replace(config, kv_cache_memory=1 << 62)
    config = replace(config, kv_cache_memory=config.kv_cache_memory + state_slots(unbounded, model)[2])
    engine = Engine.from_config(config, model=model)
    # A sliding pool of its own (a sliding model, the prefix cache off) is taken only where the global
    # pool then holds at least the blocks that one pool would.
    if not engine.kv.sliding.enabled:
        assert engine.num_blocks == num_blocks
    else:
        assert engine.num_blocks >= num_blocks
    # A busy test machine must not cut a load short: what an admission finds in the lower tiers
    # stays a function of the workload (tests of the budget set their own).
    engine.kv.tiers.set_budget(60.0)
    return engine


class RowClock:
    """A fake clock on which every forward pass takes `fixed` plus `row` per row (decode or draft): wrap
    a runner's `execute` with `wrap` and give the engine this clock, and speculation's measured costs are
    these, whatever the machine."""

    def __init__(self, fixed: float, row: float) -> None:
        self.now = 0.0
        self.fixed = fixed
        self.row = row

    def __call__(self) -> float:
        return self.now

    def wrap(self, execute: Callable[[ForwardBatch], StepLogits]) -> Callable[[ForwardBatch], StepLogits]:
        def timed(batch: ForwardBatch) -> StepLogits:
            self.now += self.fixed + self.row * (
                len(batch.decodes) + sum(len(c.token_ids) for c in batch.prefills)
            )
            return execute(batch)

        return timed


class OracleDrafter:
    """Drafts that are mostly right: the reference engine's own continuation of the request's prompt
    (computed on first use, alone, on a no-cache engine), cut to a random length and, often, wrong from
    a random token on. Verification must keep exactly the right prefix, whatever the draft, so every
    case exercises acceptance, rejection and rollback. Unseeded sampled requests draw seeds of their own
    in each engine: their drafts are simply often rejected."""

    def __init__(self, reference: Engine, seed: int) -> None:
        self.reference = reference
        self.random = random.Random(seed)
        self.expected: dict[str, list[int]] = {}
        self.prompts: dict[str, tuple[list[int], SamplingParams]] = {}
        self.verified_counts: list[tuple[int, int]] = []

    def added(self, key: str, prompt: list[int], params: SamplingParams) -> None:
        self.prompts[key] = (prompt, params)

    def _continuation(self, key: str) -> list[int]:
        if key not in self.expected:
            prompt, params = self.prompts[key]
            self.reference.add_request(f"oracle-{key}", prompt, replace(params, prompt_logprobs=None))
            out: list[int] = []
            while self.reference.has_unfinished_requests():
                for delta in self.reference.step():
                    out += delta.token_ids
            self.expected[key] = out
        return self.expected[key]

    def propose(
        self, key: str, namespace: str, tokens: Sequence[int], limit: int, load: int, tenant: str
    ) -> list[int]:
        del namespace, load
        if key not in self.prompts or self.random.random() < 0.2:
            return []
        prompt, _ = self.prompts[key]
        done = len(tokens) - len(prompt)
        draft = self._continuation(key)[done : done + self.random.randint(1, limit)]
        if draft and self.random.random() < 0.5:
            wrong = self.random.randrange(len(draft))
            draft = [*draft[:wrong], (draft[wrong] + 1) % 4096, *draft[wrong + 1 :]]
        return draft

    def verified(self, key: str, drafted: int, accepted: int) -> None:
        self.verified_counts.append((drafted, accepted))

    def finished(self, key: str, namespace: str, output: Sequence[int], tenant: str) -> None:
        self.prompts.pop(key, None)
        self.expected.pop(key, None)


def gate_steps(engine: Engine, monkeypatch: pytest.MonkeyPatch, timeout_s: float = 120) -> threading.Event:
    """Make every step of `engine` wait until the returned gate is set (or `timeout_s` passes), so that
    requests stay in flight however fast the tiny model is."""
    gate = threading.Event()
    step = engine.step

    def gated_step() -> list[RequestDelta]:
        gate.wait(timeout_s)
        return step()

    monkeypatch.setattr(engine, "step", gated_step)
    return gate


def greedy(
    max_tokens: int,
    prompt_logprobs: int | None = None,
    n: int = 1,
    structured_outputs: StructuredOutputs | None = None,
) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        prompt_logprobs=prompt_logprobs,
        n=n,
        structured_outputs=structured_outputs,
    )


def run_counted(
    engine: Engine,
    rid: str,
    prompt: list[int],
    max_tokens: int,
    checkpoints: Sequence[int] = (),
    namespace: str = "",
) -> tuple[list[int], int, int]:
    """Run one greedy request to its end alone: its reply, and the prompt tokens the cache served and
    those it recomputed for want of a state checkpoint; the cache's accounting checked every step."""
    engine.add_request(rid, prompt, greedy(max_tokens), checkpoints=checkpoints, namespace=namespace)
    tokens: list[int] = []
    cached = recomputed = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += delta.token_ids
            cached, recomputed = delta.num_cached_tokens, delta.num_recomputed_tokens
        engine.kv.check()
    return tokens, cached, recomputed


@dataclass
class Spec:
    """One request of a workload. Its prompt is `base` (see `prompt_of`) followed by `suffix`.

    base: ("system", k) a system prompt; ("repeat", j) request j's prompt; ("follow", j) request j's
    prompt and output, as the next turn of a chat (submitted once j has ended). `n` samples run as n
    requests submitted together; `prompt_logprobs` asks for the prompt's logprobs (computed at every
    position, cached or not). `constraint` constrains its output (the reference runs it the same way).
    `sampling` overrides greedy's SamplingParams fields (a seed and temperature, stop strings, EOS,
    penalties); the reference runs each sample with the same params.
    """

    base: tuple[str, int]
    suffix: list[int]
    max_tokens: int
    arrival: int = 0
    abort_after: int | None = None
    namespace: str = ""
    n: int = 1
    prompt_logprobs: bool = False
    constraint: StructuredOutputs | None = None
    sampling: dict[str, Any] = field(default_factory=dict)


@dataclass
class Run:
    """Outputs of sample 0 by spec index; the other samples' in `samples`, by (spec, sample)."""

    prompts: dict[int, list[int]] = field(default_factory=dict)
    outputs: dict[int, list[int]] = field(default_factory=dict)
    samples: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[float]] = field(default_factory=dict)
    aborted: set[int] = field(default_factory=set)
    max_tokens: dict[int, int] = field(default_factory=dict)
    constraints: dict[int, StructuredOutputs | None] = field(default_factory=dict)
    params: dict[int, SamplingParams] = field(default_factory=dict)
    # Per (spec, sample): prompt tokens the cache served, and how the sample ended.
    cached: dict[tuple[int, int], int] = field(default_factory=dict)
    finish_reasons: dict[tuple[int, int], str | None] = field(default_factory=dict)


def _sample_id(i: int, j: int) -> str:
    return str(i) if j == 0 else f"{i}.{j}"


def _parse_id(request_id: str) -> tuple[int, int]:
    i, _, j = request_id.partition(".")
    return int(i), int(j or 0)


def _depends_on(spec: Spec) -> int | None:
    return spec.base[1] if spec.base[0] in ("repeat", "follow") else None


def drive(
    engine: Engine,
    systems: Sequence[list[int]],
    specs: Sequence[Spec],
    check_each_step: bool = True,
    max_steps: int = 20_000,
    drop_memory_every: int | None = None,
    oracle: OracleDrafter | None = None,
) -> Run:
    """Submit each spec at its arrival step (and after what it depends on), step until all end, abort
    where a spec says so; checks the cache invariants after every step. With `drop_memory_every`, every
    that many steps the prefix cache lets go of every block no request holds (`reset_prefix_cache`), so
    that the lower tiers serve what memory would have (requests wait in the loading state)."""
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
            run.constraints[i] = spec.constraint
            params = greedy(max_tokens, 0 if spec.prompt_logprobs else None, spec.n, spec.constraint)
            params = replace(params, **spec.sampling) if spec.sampling else params
            run.params[i] = params
            for j in range(spec.n):
                run.samples[(i, j)] = []
                engine.add_request(_sample_id(i, j), prompt, params.for_sample(j), spec.namespace)
                if oracle is not None:
                    oracle.added(_sample_id(i, j), prompt, params.for_sample(j))
            submitted_at[i] = step
        for delta in engine.step():
            i, j = _parse_id(delta.request_id)
            run.samples[(i, j)] += delta.token_ids
            run.cached[(i, j)] = delta.num_cached_tokens
            run.finish_reasons[(i, j)] = delta.finish_reason
            if delta.prompt_logprobs is not None:
                run.prompt_logprobs[i] = [lp.logprob for lp in delta.prompt_logprobs[1:] if lp is not None]
            if delta.finished and not any(_sample_id(i, k) in engine.requests for k in range(specs[i].n)):
                done.add(i)
                run.outputs[i] = run.samples[(i, 0)]
        for i, at in submitted_at.items():
            after = specs[i].abort_after
            if i in done or after is None or step - at < after:
                continue
            aborted = [engine.abort_request(_sample_id(i, j)) for j in range(specs[i].n)]
            if any(aborted):
                run.aborted.add(i)
                done.add(i)
                run.outputs[i] = run.samples[(i, 0)]
        # Lower tiers write behind; waiting for them each step makes which blocks a later admission
        # finds on disk a function of the workload alone, so a failing case replays exactly.
        engine.kv.flush()
        if drop_memory_every and step % drop_memory_every == drop_memory_every - 1:
            engine.kv.reset_prefix_cache()
        if check_each_step:
            engine.kv.check()
        step += 1
        assert step < max_steps, "the engine stopped making progress"
    return run


@dataclass
class Reference:
    outputs: dict[int, list[int]]
    prompt_logprobs: dict[int, list[float]]
    # By (spec, sample): sample 0 of every spec, and the later samples of seeded specs (each its own seed).
    samples: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    finish_reasons: dict[tuple[int, int], str | None] = field(default_factory=dict)


def reference_outputs(reference: Engine, run: Run) -> Reference:
    """Every prompt of `run` generated in one batch by a no-cache engine, with its prompt logprobs."""
    for i, prompt in run.prompts.items():
        params = run.params.get(i) or greedy(run.max_tokens[i], structured_outputs=run.constraints.get(i))
        samples = 1 if params.seed is None else params.n
        params = replace(params, n=1, prompt_logprobs=0)
        for j in range(samples):
            reference.add_request(f"ref-{_sample_id(i, j)}", prompt, params.for_sample(j))
    out = Reference({i: [] for i in run.prompts}, {})
    while reference.has_unfinished_requests():
        for delta in reference.step():
            i, j = _parse_id(delta.request_id[4:])
            out.samples[(i, j)] = out.samples.get((i, j), []) + delta.token_ids
            out.finish_reasons[(i, j)] = delta.finish_reason
            if j == 0:
                out.outputs[i] += delta.token_ids
            if delta.prompt_logprobs is not None:
                out.prompt_logprobs[i] = [lp.logprob for lp in delta.prompt_logprobs[1:] if lp is not None]
    return out


def assert_matches_reference(run: Run, expected: Reference) -> None:
    """Every sample's tokens equal the reference's (greedy samples of one prompt are alike), and prompt
    logprobs, computed whatever the cache held, equal the no-cache engine's."""
    for (i, j), got in run.samples.items():
        # Unseeded samples of one prompt are alike: each compares with the reference's sample 0.
        key = (i, j) if (i, j) in expected.samples else (i, 0)
        want = expected.samples[key]
        if i in run.aborted:
            assert got == want[: len(got)], f"request {i} sample {j} (aborted) diverged from the reference"
        else:
            assert got == want, f"request {i} sample {j} diverged from the reference"
            assert run.finish_reasons[(i, j)] == expected.finish_reasons[key], f"request {i} sample {j}"
    for i, got_logprobs in run.prompt_logprobs.items():
        want_logprobs = expected.prompt_logprobs[i]
        assert len(got_logprobs) == len(want_logprobs) == len(run.prompts[i]) - 1
        torch.testing.assert_close(torch.tensor(got_logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=0)


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
    c = engine.config
    # The engine's own numbers (float64 and float32 weights in most runs; q8_0 products on the native path
    # in float32, whose rows keep their bits in any batch).
    scratch = ModelRunner(
        model,
        MAX_MODEL_LEN,
        1,
        MAX_MODEL_LEN,
        "cpu",
        c.dtype,
        c.weight_dtype,
        kv_dtype=c.kv_cache_dtype,
        int16_activations=c.activations == "int16",
    )
    # A Gated DeltaNet layer's chunked prefill rounds by where its chunks fall, so a resumed prefix's KV
    # equals a fresh one's to rounding only; every other layer kind is exact.
    tol = 1e-5 if model.config.deltanet is not None else 1e-9
    for namespace, path, block in random.Random(seed).sample(entries, min(sample, len(entries))):
        del namespace
        scratch.execute(ForwardBatch(prefills=[SequenceChunk(list(path), 0, list(range(len(path))), False)]))
        start = (len(path) - 1) // bs * bs
        n = len(path) - start
        kv = engine.runner.kv_cache
        for ours, fresh in ((kv.k, scratch.kv_cache.k), (kv.v, scratch.kv_cache.v)):
            torch.testing.assert_close(
                ours[:, block * bs : block * bs + n], fresh[:, start : start + n], atol=tol, rtol=tol
            )
