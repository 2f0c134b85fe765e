"""Adversarial sampling values through the engine, batched beside ordinary greedy requests.

Every SamplingParams is drawn from the whole range that validation accepts, its extremes weighted in:
top_k up to the vocabulary, top_p and min_p at their edges, temperatures from the smallest to 100,
penalties at their bounds, logit_bias over the whole vocabulary at +-100, 1,024 stop token ids, seeds 0
and 2**64 - 1, n up to the per-request cap, 20 logprobs and prompt logprobs, stop strings, min_tokens.
The engine must never stop, every ordinary greedy request must produce what it produces alone, and the
cache manager's invariants must hold after every step. A value this test finds fatal must be refused by
validation (InvalidRequestError, never another exception: the second test) or made safe.

`make test` runs a small derandomized set; KVSERVE_LONG_TESTS=1 runs a longer randomized search.
"""

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    SEED_SPACE,
    SamplingParams,
)
from kvserve.errors import InvalidRequestError
from kvserve.model.loader import LoadedModel
from tests.harness import engine_with_blocks

pytestmark = pytest.mark.usefixtures("one_thread")

_LONG = os.environ.get("KVSERVE_LONG_TESTS") == "1"
SETTINGS = settings(
    max_examples=400 if _LONG else 20,
    deadline=None,
    derandomize=not _LONG,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)

VOCAB = 4096  # the tiny model's (tests/conftest.py)
BLOCK = 4
MAX_SEQUENCES = 6
ORDINARY = [[100 + (i * 11 + k * 37) % 3000 for i in range(9 + 3 * k)] for k in range(3)]
ORDINARY_TOKENS = 5


def _edges(low: float, high: float, *inner: float) -> st.SearchStrategy[float]:
    return st.sampled_from([low, high, *inner]) | st.floats(low, high)


def _bias() -> st.SearchStrategy[dict[int, float] | None]:
    whole = st.sampled_from([-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]).map(
        lambda b: {t: b if t % 2 else -b for t in range(VOCAB)}
    )
    some = st.dictionaries(
        st.integers(0, VOCAB - 1), _edges(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, 0.0), max_size=8
    )
    return st.none() | whole | some


def _stop_token_ids() -> st.SearchStrategy[list[int]]:
    return st.just(list(range(MAX_STOP_TOKEN_IDS))) | st.lists(
        st.sampled_from([0, 1, 2, VOCAB - 1]) | st.integers(0, VOCAB - 1), max_size=6
    )


@st.composite
def adversarial_params(draw: st.DrawFn) -> SamplingParams:
    max_tokens = draw(st.integers(0, 6))
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=draw(_edges(0.0, MAX_TEMPERATURE, 1e-300, 1e-6, 1e-5, 1.0)),
        top_p=draw(_edges(5e-324, 1.0, 1e-9, 0.5).filter(lambda p: p > 0)),
        top_k=draw(st.sampled_from([-1, 0, 1, VOCAB - 1, VOCAB]) | st.integers(-1, VOCAB)),
        min_p=draw(_edges(0.0, 1.0, 1e-9)),
        seed=draw(st.sampled_from([None, 0, SEED_SPACE - 1]) | st.integers(0, SEED_SPACE - 1)),
        stop=draw(st.lists(st.text(min_size=1, max_size=3), max_size=16)),
        stop_token_ids=draw(_stop_token_ids()),
        include_stop_str_in_output=draw(st.booleans()),
        ignore_eos=draw(st.booleans()),
        min_tokens=draw(st.integers(0, max_tokens)),
        skip_special_tokens=draw(st.booleans()),
        n=draw(st.integers(1, 3) | st.just(MAX_SEQUENCES)),
        logprobs=draw(st.sampled_from([None, 0, MAX_LOGPROBS]) | st.integers(0, MAX_LOGPROBS)),
        prompt_logprobs=draw(st.sampled_from([None, 0, MAX_LOGPROBS])),
        presence_penalty=draw(_edges(-MAX_PENALTY, MAX_PENALTY, 0.0)),
        frequency_penalty=draw(_edges(-MAX_PENALTY, MAX_PENALTY, 0.0)),
        repetition_penalty=draw(_edges(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY, 1.0)),
        logit_bias=draw(_bias()),
    )


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=ORDINARY_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(tiny_model: LoadedModel) -> dict[int, list[int]]:
    """Each ordinary prompt's greedy output, run alone on an engine of its own."""
    out = {}
    for k, prompt in enumerate(ORDINARY):
        engine = engine_with_blocks(tiny_model, 32, BLOCK)
        engine.add_request("alone", prompt, _greedy())
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens += delta.token_ids
        out[k] = tokens
    return out


@pytest.fixture(scope="module")
def engine(tiny_model: LoadedModel) -> Engine:
    # A small pool, shared by every example: admissions evict, decodes preempt, the cache carries over.
    return engine_with_blocks(
        tiny_model,
        40,
        BLOCK,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        max_sequences_per_request=MAX_SEQUENCES,
    )


@SETTINGS
@given(
    batch=st.lists(
        st.tuples(adversarial_params(), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)),
        min_size=1,
        max_size=3,
    ),
    ordinary=st.lists(st.integers(0, len(ORDINARY) - 1), min_size=1, max_size=3),
    ordinary_first=st.booleans(),
)
def test_accepted_values_never_stop_the_engine_nor_change_other_requests(
    engine: Engine,
    alone: dict[int, list[int]],
    batch: list[tuple[SamplingParams, list[int]]],
    ordinary: list[int],
    ordinary_first: bool,
) -> None:
    # Adversarial requests come from two tenants besides the ordinary ones', so admission takes turns.
    submissions: list[tuple[str, list[int], SamplingParams, str]] = []
    for j, (params, prompt) in enumerate(batch):
        (checked,) = engine.validate_request([prompt], params)
        submissions += [
            (f"adv{j}.{i}", checked.token_ids, params.for_sample(i), f"tenant{j % 2}")
            for i in range(params.n)
        ]
    plain = [(f"ord{i}", ORDINARY[k], _greedy(), "default") for i, k in enumerate(ordinary)]
    submissions = plain + submissions if ordinary_first else submissions + plain
    for request_id, prompt, params, tenant in submissions:
        engine.add_request(request_id, prompt, params, tenant=tenant)
    out: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out.setdefault(delta.request_id, []).extend(delta.token_ids)
            assert all(0 <= t < VOCAB for t in delta.token_ids)
        engine.kv.check()
        steps += 1
        assert steps < 2000, "the engine stopped making progress"
    for i, k in enumerate(ordinary):
        assert out[f"ord{i}"] == alone[k], f"ordinary request {i} changed beside {batch}"
    assert engine.kv.usage().num_locked == 0


_ANY = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**30])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=3)
    | st.lists(st.integers() | st.text(max_size=2) | st.floats(), max_size=3)
    | st.dictionaries(
        st.integers() | st.text(max_size=2), st.floats() | st.integers() | st.text(max_size=2), max_size=3
    )
)
_FIELDS = [
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "n",
    "logprobs",
    "prompt_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
]


@SETTINGS
@given(
    values=st.dictionaries(st.sampled_from(_FIELDS), _ANY, max_size=4),
    prompt=st.lists(st.integers(-2, VOCAB + 1) | st.sampled_from([2**64, 1.5, "7", True]), max_size=6)
    | st.sampled_from([[5], [1, 2, 3], "abc", 7, None]),
)
def test_refused_values_raise_invalid_request_error_and_accepted_ones_run(
    engine: Engine, values: dict[str, Any], prompt: Any
) -> None:
    try:
        params = SamplingParams(**values)
        checked = engine.validate_request([prompt], params)
    except InvalidRequestError as e:
        assert e.param is not None
        return
    # Accepted: it runs (a couple of steps) and leaves nothing behind when aborted.
    for i in range(params.n):
        engine.add_request(f"any.{i}", checked[0], params.for_sample(i))
    for _ in range(2):
        if engine.has_unfinished_requests():
            engine.step()
            engine.kv.check()
    for i in range(params.n):
        engine.abort_request(f"any.{i}")
    assert not engine.has_unfinished_requests()
    engine.kv.check()
