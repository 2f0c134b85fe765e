"""Speculation: drafts verified as extra rows of a step (engine/speculation.py, the scheduler's `_draft`).

- Greedy tokens and logprobs are bitwise those of the same engine without speculation, with drafts that
  are right, wrong from some token on, or cut short, on the native kernels (float32 and int16 decode
  activations).
- Sampled outputs follow the model's distribution: a chi-square test of the tokens sampled through
  accepted and rejected drafts against the model's own probabilities.
- Rollback: after every step the cache's accounting holds, a running sequence holds no block past its
  tokens, and in the end nothing leaks and the cache holds the KV of exactly its tokens.
- A constraint cuts a draft at the first token it forbids (`GrammarState.allowed_prefix`).
"""

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import pytest
import torch
from scipy.stats import chisquare

from kvserve.config import EngineConfig, default_cache_dir
from kvserve.engine.engine import Engine
from kvserve.engine.grammar import StructuredOutputs
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.loader import LoadedModel, load_model
from tests.harness import (
    OracleDrafter,
    Spec,
    assert_cached_kv_is_fresh,
    assert_no_leak,
    drive,
    engine_with_blocks,
)
from tests.helpers import save_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    [100, 101, 102, 103] * 6 + [7, 8, 9],
    list(range(200, 260)),
    [300, 301] * 20,
]


def _engine(model: LoadedModel, speculative: str, **overrides: Any) -> Engine:
    config = EngineConfig(
        weight_dtype="q8_0",
        attention="native",
        block_size=4,
        kv_cache_memory=2**22,
        max_model_len=256,
        speculative=speculative,
        **overrides,
    )
    return Engine.from_config(config, model=model)


def _run(engine: Engine, params: SamplingParams, oracle: OracleDrafter | None = None) -> dict[str, Any]:
    """Every prompt of PROMPTS run together to the end; per request its tokens and logprobs."""
    out: dict[str, Any] = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
        if oracle is not None:
            oracle.added(str(i), prompt, params)
        out[str(i)] = ([], [])
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens, logprobs = out[delta.request_id]
            tokens += delta.token_ids
            logprobs += [(lp.logprob, lp.rank, lp.top) for lp in delta.logprobs]
        engine.kv.check()
        for request in engine.scheduler.running:
            assert request.kv is not None
            assert len(request.kv.blocks) <= math.ceil(request.num_tokens / engine.config.block_size)
    assert_no_leak(engine)
    return out


@pytest.mark.parametrize("activations", ["float32", "int16"])
def test_greedy_tokens_and_logprobs_are_bitwise_those_without_speculation(
    tiny_model: LoadedModel, activations: str
) -> None:
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=3)
    plain = _run(_engine(tiny_model, "off", activations=activations), params)
    engine = _engine(tiny_model, "suffix", activations=activations)
    oracle = OracleDrafter(_engine(tiny_model, "off", activations=activations), seed=3)
    engine.scheduler.drafter = oracle
    drafted = _run(engine, params, oracle)
    assert drafted == plain
    stats = engine.stats()
    # Drafts were kept and thrown away alike, in part.
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert any(0 < accepted < drafted for drafted, accepted in oracle.verified_counts)
    assert any(accepted == 0 for _, accepted in oracle.verified_counts)


def test_the_engine_drafter_speeds_up_a_repeat_and_keeps_its_tokens(tiny_model: LoadedModel) -> None:
    """A prompt that repeats a span: greedy decoding that copies it is drafted from the prompt itself."""
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    plain = _run(_engine(tiny_model, "off"), params)
    engine = _engine(tiny_model, "suffix")
    drafted = _run(engine, params)
    assert drafted == plain
    stats = engine.stats()
    assert stats.spec_accepted_tokens <= stats.spec_draft_tokens
    assert stats.generation_tokens == sum(len(t) for t, _ in plain.values())


@pytest.mark.parametrize(
    ("block_size", "num_blocks", "budget"), [(1, 70, 512), (2, 36, 512), (4, 40, 1), (8, 9, 5)]
)
def test_rejected_drafts_leave_nothing_behind(
    tiny_model: LoadedModel, block_size: int, num_blocks: int, budget: int
) -> None:
    """Block size 1, a pool that barely fits one request, a 1-token budget: drafts of up to 64 tokens,
    mostly wrong somewhere; every step's accounting holds, nothing leaks, and every cached block holds
    the KV of its own tokens (a rejected token's KV published would differ)."""
    engine = engine_with_blocks(
        tiny_model,
        num_blocks,
        block_size,
        max_num_batched_tokens=budget,
        speculative_tokens=64,
        attention="native",
    )
    reference = engine_with_blocks(tiny_model, 1024, 16, enable_prefix_caching=False, speculative="off")
    oracle = OracleDrafter(reference, seed=block_size)
    engine.scheduler.drafter = oracle
    specs = [
        Spec(base=("system", 0), suffix=[5, 6, 7], max_tokens=30),
        Spec(base=("follow", 0), suffix=[8, 9], max_tokens=20, arrival=1),
        Spec(
            base=("repeat", 0), suffix=[], max_tokens=25, arrival=2, sampling={"temperature": 1.0, "seed": 7}
        ),
    ]
    run = drive(engine, [[100 + i % 7 for i in range(20)]], specs, oracle=oracle)
    for i, spec in enumerate(specs):
        assert len(run.outputs[i]) == min(spec.max_tokens, len(run.outputs[i]))
    assert_no_leak(engine)
    assert_cached_kv_is_fresh(engine, tiny_model, sample=40)
    if budget > 1:
        assert engine.stats().spec_draft_tokens > engine.stats().spec_accepted_tokens > 0
    else:
        assert engine.stats().spec_drafts == 0


class _FixedDrafter:
    """Drafts `draft` after `after`, nothing otherwise."""

    def __init__(self, after: int, draft: list[int]) -> None:
        self.after, self.draft = after, draft

    def propose(
        self, key: str, namespace: str, tokens: Sequence[int], limit: int, load: int, tenant: str
    ) -> list[int]:
        return self.draft[:limit] if tokens[-1] == self.after else []

    def verified(self, key: str, drafted: int, accepted: int) -> None:
        pass

    def finished(self, key: str, namespace: str, output: Sequence[int], tenant: str) -> None:
        pass


VOCAB = 8
SAMPLES = 3000


@pytest.fixture(scope="module")
def eight_token_model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = save_tiny_model(str(tmp_path_factory.mktemp("vocab8") / "llama"), "llama", vocab_size=VOCAB)
    return load_model(path, default_cache_dir())


def _sample_all(
    engine: Engine, prompt: list[int], seeds: range
) -> list[tuple[list[int], list[dict[int, float]]]]:
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True, logprobs=VOCAB)
    for seed in seeds:
        engine.add_request(str(seed), prompt, replace(params, seed=seed))
    out: dict[str, tuple[list[int], list[dict[int, float]]]] = {str(s): ([], []) for s in seeds}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens, dists = out[delta.request_id]
            tokens += delta.token_ids
            dists += [dict(lp.top) for lp in delta.logprobs]
    return list(out.values())


def _fit(
    samples: list[tuple[list[int], list[dict[int, float]]]], position: int, prefix: tuple[int, ...]
) -> float:
    """The chi-square p-value of the tokens sampled at `position` after `prefix` against the model's own
    distribution there (every sample with that prefix has the same one)."""
    group = [(t, d) for t, d in samples if tuple(t[:position]) == prefix]
    assert len(group) >= 200, f"too few samples after {prefix}: {len(group)}"
    probs = torch.tensor([math.exp(group[0][1][position][k]) for k in range(VOCAB)], dtype=torch.float64)
    expected = (probs / probs.sum() * len(group)).tolist()
    counts = Counter(t[position] for t, _ in group)
    observed = [counts[k] for k in range(VOCAB)]
    # Cells expected below 5 are pooled into one, as the test needs.
    small = [k for k in range(VOCAB) if expected[k] < 5]
    keep = [k for k in range(VOCAB) if expected[k] >= 5]
    obs = [observed[k] for k in keep] + ([sum(observed[k] for k in small)] if small else [])
    exp = [expected[k] for k in keep] + ([sum(expected[k] for k in small)] if small else [])
    return float(chisquare(obs, exp).pvalue)


def test_sampled_tokens_through_drafts_follow_the_model_distribution(eight_token_model: LoadedModel) -> None:
    """Seeded samples of an eight-token model: the drafted token d is offered after the first token's
    most common value x. The second token (sampled where the draft is accepted or rejected) and the
    third (sampled from the draft's own row when it was accepted) follow the model's probabilities."""
    prompt = [3, 4, 5]
    pilot = _sample_all(_engine(eight_token_model, "off", max_num_seqs=256), prompt, range(400))
    x = Counter(t[0] for t, _ in pilot).most_common(1)[0][0]
    d = Counter(t[1] for t, _ in pilot if t[0] == x).most_common(1)[0][0]
    engine = _engine(eight_token_model, "suffix", max_num_seqs=256)
    engine.scheduler.drafter = _FixedDrafter(x, [d, d])
    samples = _sample_all(engine, prompt, range(10_000, 10_000 + SAMPLES))
    assert engine.stats().spec_accepted_tokens > 200
    assert _fit(samples, 1, (x,)) > 1e-3
    assert _fit(samples, 2, (x, d)) > 1e-3


def test_a_constraint_cuts_a_draft_at_the_first_token_it_forbids(tiny_model: LoadedModel) -> None:
    engine = _engine(tiny_model, "off")
    (checked,) = engine.validate_request(
        [[100, 101]], SamplingParams(structured_outputs=StructuredOutputs(regex="ab+"))
    )
    assert checked.grammar is not None
    state = checked.grammar.start()
    tokenizer = engine.tokenizer
    a, b, c = (tokenizer.encode(s)[0] for s in ("a", "b", "c"))
    assert state.allowed_prefix([a, b, b, c, b]) == 3
    assert state.allowed_prefix([c]) == 0
    assert state.allowed_prefix([]) == 0
    # Nothing was consumed: the grammar still starts at "a".
    assert state.accept(a) and not state.matcher.is_error()
    assert state.allowed_prefix([a]) == 0 and state.allowed_prefix([b, b]) == 2


WEATHER = {
    "type": "object",
    "properties": {"temperature_in_celsius": {"type": "integer"}, "conditions_described": {"type": "string"}},
    "required": ["temperature_in_celsius", "conditions_described"],
    "additionalProperties": False,
}


def test_tokens_a_grammar_forces_are_drafted_and_kept(make_engine: Callable[..., Engine]) -> None:
    """A JSON schema's keys are forced: they are drafted from the grammar alone (the drafter proposes
    nothing), the model keeps them, and the output is the one without speculation."""
    params = SamplingParams(
        max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputs(json=WEATHER), logprobs=2
    )
    prompt = make_engine().tokenizer.encode("The weather in Paris as JSON:")

    def run(engine: Engine) -> tuple[list[int], list[Any]]:
        engine.add_request("0", prompt, params)
        tokens: list[int] = []
        logprobs: list[Any] = []
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens += delta.token_ids
                logprobs += [(lp.logprob, lp.rank, lp.top) for lp in delta.logprobs]
        assert_no_leak(engine)
        return tokens, logprobs

    plain = run(make_engine(speculative="off"))
    engine = make_engine()
    engine.scheduler.drafter = _FixedDrafter(-1, [])
    assert run(engine) == plain
    stats = engine.stats()
    # At least `{"temperature_in_celsius` and `","conditions_described` came as drafts, and were kept.
    assert stats.spec_drafts >= 2 and stats.spec_accepted_tokens >= 8
    assert stats.spec_accepted_tokens >= 0.8 * stats.spec_draft_tokens


def test_forced_tokens_leave_the_grammar_where_it_was(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(speculative="off")
    answer = StructuredOutputs(regex="The answer is: [0-9]+ exactly")
    (checked,) = engine.validate_request([[100, 101]], SamplingParams(structured_outputs=answer))
    assert checked.grammar is not None
    state = checked.grammar.start()
    forced = state.forced(64)
    assert engine.tokenizer.decode(forced) == "The answer is: "
    assert state.forced(2) == forced[:2] and state.forced(0) == []
    for token in forced:
        assert state.accept(token)
    # A digit comes next, of the model's choosing: nothing is forced.
    assert state.forced(64) == []
    assert state.accept(engine.tokenizer.encode("4")[0]) and state.forced(64) == []
