"""Structured outputs in the engine: JSON schemas, regexes, choices and grammars, alone and batched.

A tiny random model with the real tokenizer's whole vocabulary (the grammar library steers forced text
to its canonical tokens, which the 4,096-token tiny model of conftest.py may lack) writes whatever its
grammar lets it: every schema here bounds its strings, arrays and numbers, so every output ends within
max_tokens and must validate (the `jsonschema` package). Unconstrained greedy requests batched beside
constrained ones must produce what they produce alone.
"""

import json
import re
from typing import Any

import jsonschema
import pytest
import torch

from kvserve.engine.engine import Engine
from kvserve.engine.grammar import GrammarCompiler, StructuredOutputs
from kvserve.engine.sampling_params import SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.llm import LLM
from kvserve.model.loader import LoadedModel
from tests.harness import engine_with_blocks

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4
PROMPTS = [[100 + (i * 13 + k * 41) % 3000 for i in range(7 + 2 * k)] for k in range(3)]
MAX_TOKENS = 160

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 6},
                    "admin": {"type": "boolean"},
                },
                "required": ["name", "admin"],
                "additionalProperties": False,
            },
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
        },
        "required": ["user", "id"],
        "additionalProperties": False,
    },
    "bounded_array_enum": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3,
            },
            "size": {"enum": ["S", "M", "L"]},
        },
        "required": ["tags", "size"],
        "additionalProperties": False,
    },
    "number_ranges_optional": {
        "type": "object",
        "properties": {
            "score": {"type": "integer", "minimum": -5, "maximum": 50},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.25},
            "note": {"type": "string", "maxLength": 4},
        },
        "required": ["score"],
        "additionalProperties": False,
    },
    "defs_ref_anyof": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["x"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "where": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"}, {"enum": ["here", "there"]}]},
            "points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 2},
        },
        "required": ["where", "points"],
        "additionalProperties": False,
    },
}


def _run(
    engine: Engine, requests: list[tuple[list[int], SamplingParams]]
) -> list[tuple[list[int], str, str]]:
    """Run requests together (one batch) to the end: (token ids, text, finish reason) of each."""
    ids = []
    for i, (prompt, params) in enumerate(requests):
        (checked,) = engine.validate_request([prompt], params)
        engine.add_request(str(i), checked, params)
        ids.append(str(i))
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    texts = dict.fromkeys(ids, "")
    reasons: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
            texts[delta.request_id] += delta.text
            if delta.finished:
                reasons[delta.request_id] = delta.finish_reason or ""
        engine.kv.check()
    return [(tokens[i], texts[i], reasons[i]) for i in ids]


def _greedy(max_tokens: int = 8, so: StructuredOutputs | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, structured_outputs=so)


@pytest.fixture(scope="module")
def model(tiny_full_vocab_model: LoadedModel) -> LoadedModel:
    return tiny_full_vocab_model


@pytest.fixture(scope="module")
def engine(model: LoadedModel) -> Engine:
    return engine_with_blocks(model, 256, BLOCK)


@pytest.fixture(scope="module")
def plain_alone(engine: Engine) -> list[list[int]]:
    return [_run(engine, [(p, _greedy())])[0][0] for p in PROMPTS[:2]]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_output_validates_and_the_unconstrained_rows_beside_it_do_not_change(
    engine: Engine, plain_alone: list[list[int]], name: str
) -> None:
    schema = SCHEMAS[name]
    so = StructuredOutputs(json=schema)
    constrained = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=so)] + [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, structured_outputs=so)
        for seed in (1, 2, 3)
    ]
    batch = [(PROMPTS[2], p) for p in constrained] + [(p, _greedy()) for p in PROMPTS[:2]]
    results = _run(engine, batch)
    for _, text, reason in results[: len(constrained)]:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)
    assert [r[0] for r in results[len(constrained) :]] == plain_alone
    # Seeded samples are reproducible whatever they are batched with.
    again = _run(engine, [(PROMPTS[2], constrained[1])])
    assert again[0][1] == results[1][1]


def test_json_object_regex_choice_and_grammar_outputs_match(engine: Engine) -> None:
    cases = [
        (StructuredOutputs(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (StructuredOutputs(regex=r"[a-f]{2,4}-[0-9]{3}"), lambda t: re.fullmatch(r"[a-f]{2,4}-[0-9]{3}", t)),
        (StructuredOutputs(choice=["yes", "no", "perhaps not"]), lambda t: t in ("yes", "no", "perhaps not")),
        (
            StructuredOutputs(grammar='start: sum\nsum: NUM ("+" NUM)*\nNUM: /[1-9][0-9]?/'),
            lambda t: re.fullmatch(r"[1-9][0-9]?(\+[1-9][0-9]?)*", t),
        ),
    ]
    for so, ok in cases:
        for temperature, seed in ((0.0, None), (1.0, 7)):
            params = SamplingParams(max_tokens=60, temperature=temperature, seed=seed, structured_outputs=so)
            ((_, text, reason),) = _run(engine, [(PROMPTS[0], params)])
            if so.json_object and reason == "length":
                continue  # an unbounded object may run past max_tokens; the others are bounded
            assert reason == "stop" and ok(text), (so.kind, text)  # type: ignore[no-untyped-call]


def test_the_end_of_sequence_comes_only_where_the_grammar_accepts(engine: Engine) -> None:
    eos = engine.tokenizer.eos_token_ids[0]
    pattern = r"[0-9]{6}"
    params = SamplingParams(
        max_tokens=20,
        temperature=0.0,
        logit_bias={eos: 100.0},
        structured_outputs=StructuredOutputs(regex=pattern),
    )
    ((_, text, reason),) = _run(engine, [(PROMPTS[1], params)])
    assert re.fullmatch(pattern, text) and reason == "stop"
    # Without the grammar the bias ends it at once.
    ((_, plain, _),) = _run(
        engine, [(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.0, logit_bias={eos: 100.0}))]
    )
    assert plain == ""


def test_a_grammar_that_cannot_finish_within_max_tokens_ends_with_length(engine: Engine) -> None:
    params = SamplingParams(
        max_tokens=4, temperature=0.0, structured_outputs=StructuredOutputs(regex="x{40}")
    )
    ((tokens, text, reason),) = _run(engine, [(PROMPTS[0], params)])
    assert reason == "length" and len(tokens) == 4 and set(text) <= {"x"}


def test_min_tokens_does_not_keep_a_finished_grammar_going(engine: Engine) -> None:
    params = SamplingParams(
        max_tokens=10, min_tokens=8, temperature=0.0, structured_outputs=StructuredOutputs(choice=["ok"])
    )
    ((_, text, reason),) = _run(engine, [(PROMPTS[0], params)])
    assert (text, reason) == ("ok", "stop")


def test_n_samples_each_follow_their_own_grammar_state(engine: Engine) -> None:
    so = StructuredOutputs(json=SCHEMAS["bounded_array_enum"])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=11, n=4, structured_outputs=so)
    (checked,) = engine.validate_request([PROMPTS[0]], params)
    batch = [(checked.token_ids, params.for_sample(i)) for i in range(4)]
    texts = [text for _, text, _ in _run(engine, batch)]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS["bounded_array_enum"])
    assert len(set(texts)) > 1


def test_logprobs_stay_those_of_the_model(engine: Engine) -> None:
    so = StructuredOutputs(choice=["zzz"])
    constrained = SamplingParams(max_tokens=1, temperature=0.0, logprobs=3, structured_outputs=so)
    plain = SamplingParams(max_tokens=1, temperature=0.0, logprobs=3)
    results = {}
    for name, params in (("constrained", constrained), ("plain", plain)):
        (checked,) = engine.validate_request([PROMPTS[0]], params)
        engine.add_request(name, checked, params)
        while engine.has_unfinished_requests():
            for delta in engine.step():
                results[delta.request_id] = delta.logprobs[0]
    assert results["constrained"].top == results["plain"].top
    assert results["constrained"].token_id != results["plain"].token_id


def test_preempted_constrained_requests_resume_their_grammar(model: LoadedModel) -> None:
    so = StructuredOutputs(json=SCHEMAS["nested"])
    batch = [(p, SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=so)) for p in PROMPTS]
    roomy = _run(engine_with_blocks(model, 256, BLOCK), batch)
    tight_engine = engine_with_blocks(model, 12, BLOCK)
    tight = _run(tight_engine, batch)
    assert tight_engine.stats().preemptions > 0
    assert tight == roomy


def test_a_rejected_constraint_is_an_invalid_request_naming_the_problem(engine: Engine) -> None:
    bad = [
        (
            StructuredOutputs(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
            "json",
        ),
        (StructuredOutputs(regex="(ab"), "regex"),
        (StructuredOutputs(grammar="start: undefined_rule"), "grammar"),
        (StructuredOutputs(json='{"type": '), "json"),
    ]
    for so, param in bad:
        with pytest.raises(InvalidRequestError) as info:
            engine.validate_request([PROMPTS[0]], SamplingParams(structured_outputs=so))
        assert info.value.param == param
        assert len(info.value.message) > 20
    with pytest.raises(InvalidRequestError):
        StructuredOutputs(regex="a", choice=["a"])
    with pytest.raises(InvalidRequestError):
        StructuredOutputs()


def test_grammars_compile_once_per_source_at_validation_never_in_the_step(
    model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_with_blocks(model, 64, BLOCK)
    params = SamplingParams(
        max_tokens=5, temperature=0.0, structured_outputs=StructuredOutputs(regex="[a-z]+")
    )
    (checked,) = engine.validate_request([PROMPTS[0]], params)
    engine.validate_request([PROMPTS[1]], params)
    assert engine.grammars.compiled == 1

    def no_compile(*_: Any) -> Any:
        raise AssertionError("compiled on the engine thread")

    monkeypatch.setattr(engine.grammars, "compile", no_compile)
    engine.add_request("a", checked, params)
    while engine.has_unfinished_requests():
        engine.step()


def test_the_grammar_cache_is_bounded_least_recently_used_first(engine: Engine) -> None:
    compiler = GrammarCompiler(engine.tokenizer.backend, engine.tokenizer.vocab_size, (2,), max_cached=2)
    a, b, c = (StructuredOutputs(regex=r) for r in ("a+", "b+", "c+"))
    compiler.compile(a)
    compiler.compile(b)
    compiler.compile(a)  # a hit, and now the most recent
    assert compiler.compiled == 2
    compiler.compile(c)  # evicts b
    assert len(compiler) == 2 and compiler.compiled == 3
    compiler.compile(b)
    assert compiler.compiled == 4
    assert compiler.compile(c) is not None and compiler.compiled == 4


def test_a_constrained_row_changes_no_other_row_bitwise(engine: Engine) -> None:
    """The sampler's output for unconstrained rows is the same with or without a constrained row."""
    from kvserve.engine import sampler
    from kvserve.engine.request import Request

    def request(params: SamplingParams, grammar: bool) -> Request:
        (checked,) = engine.validate_request([PROMPTS[0]], params)
        return Request(
            "r",
            checked.token_ids,
            params,
            4,
            None,  # type: ignore[arg-type]
            grammar=checked.grammar.start() if grammar else None,  # type: ignore[arg-type, union-attr]
        )

    torch.manual_seed(0)
    logits = torch.randn(3, 49152)
    sampled = SamplingParams(temperature=0.9, top_p=0.8, seed=5)
    so = SamplingParams(temperature=0.9, seed=5, structured_outputs=StructuredOutputs(regex="[0-9]+"))
    alone = sampler.sample(logits[[0, 2]], [request(sampled, False), request(_greedy(), False)])
    mixed = sampler.sample(logits, [request(sampled, False), request(so, True), request(_greedy(), False)])
    assert [mixed[0], mixed[2]] == alone
    assert engine.tokenizer.decode([mixed[1]]).isdigit()


def test_regression_properties_come_in_the_schema_order_not_sorted(engine: Engine) -> None:
    """The grammar cache key once serialized schemas with sorted keys, and the library wrote the
    properties in that order instead of the schema's."""
    schema = {
        "type": "object",
        "properties": {"zeta": {"enum": [1]}, "alpha": {"enum": [2]}},
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
    }
    params = SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=StructuredOutputs(json=schema))
    ((_, text, reason),) = _run(engine, [(PROMPTS[0], params)])
    assert (text, reason) == ('{"zeta":1,"alpha":2}', "stop")


def test_llm_takes_structured_outputs_through_sampling_params(model: LoadedModel) -> None:
    llm = LLM(model.path, kv_cache_memory=8 * 2**20, max_model_len=256)
    choice = SamplingParams(
        max_tokens=20, temperature=0.0, structured_outputs=StructuredOutputs(choice=["ab", "cd"])
    )
    for out in llm.generate(["Pick:", "Again:"], choice):
        assert out.outputs[0].text in ("ab", "cd") and out.outputs[0].finish_reason == "stop"
    pattern = r"[a-z]{3}[0-9]"
    sampled = SamplingParams(
        max_tokens=20, temperature=1.0, seed=4, n=3, structured_outputs=StructuredOutputs(regex=pattern)
    )
    (out,) = llm.chat([{"role": "user", "content": "hi"}], sampled)
    assert all(re.fullmatch(pattern, c.text) for c in out.outputs)
