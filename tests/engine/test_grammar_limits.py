"""Grammars bounded in time and bytes: the library's limits are the server's, a request that reaches one
ends alone ("grammar_limit") or is refused at compile time, the compiled-grammar cache holds no state a
request can grow, is keyed by namespace and bounded in bytes, and rejected constraints are remembered
briefly per namespace. Hostile grammars (tests/hostile_grammars.py) drawn by hypothesis leave the
process's memory bounded and another tenant's greedy output unchanged.

A tiny random model with the real tokenizer's whole vocabulary writes whatever its grammar lets it.
"""

import gc
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.grammar import ConstraintRejected, GrammarCompiler, GrammarLimits, StructuredOutputs
from kvserve.engine.request import GRAMMAR_LIMIT
from kvserve.engine.sampling_params import SamplingParams
from kvserve.errors import ConfigError, InvalidRequestError
from kvserve.model.loader import LoadedModel
from tests.hostile_grammars import deep_nesting, huge_alternation, overlapping_terminals

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [100, 200, 300]
OTHER_PROMPT = [1000, 1100, 1200, 1300]
# Limits under which the review's grammar compiles, then reaches the lexer's cap two tokens in.
LOOSE = {"grammar_max_lexer_states": 50_000, "grammar_step_lexer_fuel": 100_000}
# What the property test lets the cache hold, and the growth of the process it tolerates.
CACHE_BYTES = 256 * 1024
MAX_RSS_GROWTH = 300 * 2**20


@pytest.fixture(scope="module")
def model(tiny_full_vocab_model: LoadedModel) -> LoadedModel:
    return tiny_full_vocab_model


def _engine(model: LoadedModel, **config: Any) -> Engine:
    return Engine.from_config(EngineConfig(kv_cache_memory=16 * 2**20, block_size=4, **config), model=model)


def _run(
    engine: Engine, requests: list[tuple[list[int], SamplingParams, str]]
) -> list[tuple[list[int], str]]:
    """Validate each request in its namespace, run them together (one batch) to the end: the tokens
    and the finish reason of each."""
    ids = []
    for i, (prompt, params, namespace) in enumerate(requests):
        (checked,) = engine.validate_request([prompt], params, namespace)
        engine.add_request(str(i), checked, params, namespace)
        ids.append(str(i))
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    reasons: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
            if delta.finished:
                reasons[delta.request_id] = delta.finish_reason or ""
    return [(tokens[i], reasons[i]) for i in ids]


def _constrained(grammar: str, max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, structured_outputs=StructuredOutputs(grammar=grammar)
    )


def _greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_regression_an_exhausted_grammar_still_works_for_the_next_request_with_its_source(
    model: LoadedModel,
) -> None:
    """The cached template's copies shared its lexer: once one request had grown it to the library's cap,
    every later request with the same source (another tenant's too) got only the end of sequence."""
    engine = _engine(model, **LOOSE)
    grammar = overlapping_terminals()
    ((tokens, reason),) = _run(engine, [(PROMPT, _constrained(grammar), "a")])
    assert reason == GRAMMAR_LIMIT and tokens, "the grammar should reach its lexer's cap while generating"
    eos = set(engine.tokenizer.eos_token_ids)
    for namespace in ("a", "b"):
        ((again, again_reason),) = _run(engine, [(PROMPT, _constrained(grammar, len(tokens)), namespace)])
        assert again_reason == "length" and again == tokens and not eos & set(again)


def test_a_request_that_reaches_a_limit_ends_alone_and_other_rows_do_not_change(model: LoadedModel) -> None:
    engine = _engine(model, **LOOSE)
    (alone,) = _run(engine, [(OTHER_PROMPT, _greedy(), "b")])
    hostile, other = _run(
        engine, [(PROMPT, _constrained(overlapping_terminals()), "a"), (OTHER_PROMPT, _greedy(), "b")]
    )
    assert hostile[1] == GRAMMAR_LIMIT
    assert other == alone


def test_a_grammar_over_the_limits_at_its_first_token_is_refused_and_remembered(model: LoadedModel) -> None:
    engine = _engine(model)  # the default limits: the review's grammar cannot start under them
    params = _constrained(overlapping_terminals())
    with pytest.raises(ConstraintRejected, match="grammar limits"):
        engine.validate_request([PROMPT], params, "a")
    compiler = engine.grammars
    refused = len(compiler._rejections)
    with pytest.raises(ConstraintRejected, match="grammar limits"):
        engine.validate_request([PROMPT], params, "a")
    assert len(compiler._rejections) == refused


def test_a_rejected_constraint_is_remembered_per_namespace_without_compiling_again(
    model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler = _engine(model).grammars
    bad = StructuredOutputs(grammar="start: undefined_rule")
    with pytest.raises(ConstraintRejected) as first:
        compiler.compile(bad, "a")
    calls = []
    instantiate = compiler._instantiate

    def counted(*args: Any) -> Any:
        calls.append(args)
        return instantiate(*args)

    monkeypatch.setattr(compiler, "_instantiate", counted)
    with pytest.raises(ConstraintRejected) as again:
        compiler.compile(bad, "a")
    assert not calls and again.value.message == first.value.message and again.value.param == "grammar"
    # Another namespace learns nothing from the first: it compiles, and is refused on its own.
    with pytest.raises(ConstraintRejected):
        compiler.compile(bad, "b")
    assert len(calls) == 1


def test_a_rejection_is_forgotten_after_its_time(model: LoadedModel) -> None:
    engine = _engine(model)
    compiler = GrammarCompiler(
        engine.tokenizer.backend, engine.tokenizer.vocab_size, (2,), rejection_ttl_s=0.0
    )
    bad = StructuredOutputs(regex="(ab")
    for _ in range(2):
        with pytest.raises(ConstraintRejected):
            compiler.compile(bad, "a")
    assert len(compiler._rejections) == 1  # the expired entry was replaced, not kept beside


def test_the_grammar_cache_is_keyed_by_namespace(model: LoadedModel) -> None:
    compiler = _engine(model).grammars
    spec = StructuredOutputs(regex="[a-z]{3}")
    compiler.compile(spec, "a")
    compiler.compile(spec, "a")
    assert compiler.compiled == 1
    # Another tenant's first use of the same source is a miss: a hit would tell it the source was seen.
    compiler.compile(spec, "b")
    assert compiler.compiled == 2 and len(compiler) == 2


def test_the_grammar_cache_is_bounded_in_bytes_least_recently_used_first(model: LoadedModel) -> None:
    engine = _engine(model)
    specs = [StructuredOutputs(regex=f"{letter}{{1,3}}" + "x" * 20_000) for letter in "abcd"]
    entry = GrammarCompiler(engine.tokenizer.backend, engine.tokenizer.vocab_size, (2,))
    entry.compile(specs[0])
    size = entry.cached_bytes
    assert size > 2 * 20_000  # the source and the library's text of it, both counted
    compiler = GrammarCompiler(
        engine.tokenizer.backend, engine.tokenizer.vocab_size, (2,), max_cached_bytes=3 * size
    )
    for spec in specs:
        compiler.compile(spec)
        assert compiler.cached_bytes <= 3 * size
    assert len(compiler) == 3 and compiler.compiled == 4
    compiler.compile(specs[0])  # evicted first, so compiled again
    assert compiler.compiled == 5
    # An entry larger than the whole budget is used, not cached.
    small = GrammarCompiler(
        engine.tokenizer.backend, engine.tokenizer.vocab_size, (2,), max_cached_bytes=size // 2
    )
    assert small.compile(specs[1]).start() is not None
    assert len(small) == 0 and small.cached_bytes == 0


def test_each_request_gets_a_matcher_of_its_own(model: LoadedModel) -> None:
    compiler = _engine(model).grammars
    spec = StructuredOutputs(regex="[a-z]+")
    first, second = compiler.compile(spec, "a"), compiler.compile(spec, "a")
    assert first is not second and first._matcher is not second._matcher


def test_the_masks_are_begun_before_the_forward_pass_and_joined_after(
    model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(model)
    events: list[str] = []
    start, execute = engine.masks.start, engine.runner.execute

    def started(*args: Any) -> Any:
        masks = start(*args)
        events.append("masks" if masks is not None else "none")
        return masks

    def forward(*args: Any) -> Any:
        events.append("forward")
        return execute(*args)

    monkeypatch.setattr(engine.masks, "start", started)
    monkeypatch.setattr(engine.runner, "execute", forward)
    _run(engine, [(PROMPT, _constrained('start: "ab" NUM\nNUM: /[0-9]{3}/', 6), "a")])
    assert events[:2] == ["masks", "forward"] and events.count("masks") == events.count("forward")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("grammar_max_lexer_states", 0),
        ("grammar_step_lexer_fuel", -1),
        ("grammar_step_max_items", 2**31),
        ("grammar_initial_lexer_fuel", 10**30),
        ("grammar_max_size", 0),
        ("grammar_cache_bytes", 0),
    ],
)
def test_a_bad_grammar_limit_is_a_config_error(field: str, value: int) -> None:
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**{field: value})  # type: ignore[arg-type]


def test_the_limits_reach_the_library() -> None:
    limits = GrammarLimits(max_lexer_states=123, step_lexer_fuel=456, step_max_items=789)
    library = limits.library()
    assert (library.max_lexer_states, library.step_lexer_fuel, library.step_max_items) == (123, 456, 789)
    assert not library.verbose_errors


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


HOSTILE = st.one_of(
    st.builds(overlapping_terminals, st.integers(20, 80), st.integers(3, 8), st.text("xyz", max_size=3)),
    st.builds(huge_alternation, st.integers(500, 6000), st.text("xyz", max_size=3)),
    st.builds(deep_nesting, st.integers(50, 400), st.text("xyz", max_size=3)),
)


@pytest.fixture(scope="module")
def property_engine(model: LoadedModel) -> Engine:
    return _engine(model, grammar_cache_bytes=CACHE_BYTES, **LOOSE)


@pytest.fixture(scope="module")
def rss_before(property_engine: Engine) -> int:
    _run(property_engine, [(OTHER_PROMPT, _greedy(), "b")])  # the first run's allocations are not growth
    gc.collect()
    return _rss()


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(grammar=HOSTILE)
def test_hostile_grammars_fail_alone_in_bounded_memory(
    property_engine: Engine, rss_before: int, grammar: str
) -> None:
    engine = property_engine
    (alone,) = _run(engine, [(OTHER_PROMPT, _greedy(), "b")])
    hostile = (PROMPT, _constrained(grammar), "evil")
    try:
        results = _run(engine, [hostile, (OTHER_PROMPT, _greedy(), "b")])
    except InvalidRequestError:
        # Refused at compile time (a 400 over HTTP); the other tenant runs as it does alone.
        results = [([], "refused"), *_run(engine, [(OTHER_PROMPT, _greedy(), "b")])]
    assert results[0][1] in ("refused", "stop", "length", GRAMMAR_LIMIT)
    assert results[1] == alone
    assert engine.grammars.cached_bytes <= CACHE_BYTES
    gc.collect()
    assert _rss() - rss_before < MAX_RSS_GROWTH
