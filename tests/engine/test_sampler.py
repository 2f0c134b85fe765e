"""The sampler on its own: greedy, the filters, the distribution it draws from, and seeded reproducibility."""

from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.request import Request
from kvserve.engine.sampler import argmax, sample
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.text_stream import TextStream


def request(seed: int | None = 0, **params: Any) -> Request:
    return Request("r", [1], SamplingParams(seed=seed, **params), 8, TextStream(None, []), seed=7)  # type: ignore[arg-type]


LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625] + [0.0] * 3])).clamp(min=-1e9)


def draw(n: int, **params: Any) -> Counter[int]:
    r = request(**params)
    return Counter(sample(LOGITS, [r])[0] for _ in range(n))


def test_greedy_takes_the_argmax_and_mixed_batches_keep_rows_apart() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    assert sample(logits, [request(temperature=0.0), request(temperature=0.0)]) == [1, 0]
    tokens = sample(logits, [request(temperature=0.0), request(temperature=1.0)])
    assert tokens[0] == 1 and 0 <= tokens[1] < 3


# Values that tie, NaN, infinities and signed zeros, over vocabularies below, at and past whole chunks.
_VALUES = st.sampled_from(
    [0.0, -0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan"), 1e38, -1e-38]
)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 3),
    st.sampled_from([1, 5, 1023, 1024, 1025, 3000, 4096]),
    st.lists(st.tuples(st.integers(0, 2), st.integers(0, 4095), _VALUES), max_size=12),
    st.integers(0, 2**31),
)
def test_the_chunked_argmax_is_torchs(
    rows: int, vocab: int, writes: list[tuple[int, int, float]], seed: int
) -> None:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)).round()
    for row, col, value in writes:
        logits[row % rows, col % vocab] = value
    assert argmax(logits) == logits.argmax(dim=-1).tolist()


def test_draws_follow_the_distribution() -> None:
    counts = draw(4000, temperature=1.0)
    assert set(counts) <= {0, 1, 2, 3, 4}
    for token, p in enumerate([0.5, 0.25, 0.125, 0.0625, 0.0625]):
        assert abs(counts[token] / 4000 - p) < 0.03


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        ({"top_k": 2}, {0, 1}),
        ({"top_p": 0.7}, {0, 1}),
        ({"top_p": 0.01}, {0}),
        ({"min_p": 0.3}, {0, 1}),
        ({"top_k": 3, "min_p": 0.2}, {0, 1, 2}),
    ],
)
def test_filters_keep_only_their_tokens(params: dict[str, Any], allowed: set[int]) -> None:
    assert set(draw(600, temperature=1.0, **params)) == allowed


def test_a_wide_nucleus_falls_back_to_a_full_sort() -> None:
    flat = torch.zeros(1, 5000)
    flat[0, :4000] = 1.0
    r = request(temperature=1.0, top_p=0.5)
    picks = {sample(flat, [r])[0] for _ in range(300)}
    assert picks <= set(range(4000)) and len(picks) > 100


def test_the_same_seed_draws_the_same_tokens() -> None:
    a, b = request(seed=3, temperature=1.0), request(seed=3, temperature=1.0)
    noise = request(seed=None, temperature=1.0)
    first = [sample(LOGITS, [a])[0] for _ in range(50)]
    second = [sample(LOGITS.repeat(2, 1), [noise, b])[1] for _ in range(50)]
    assert first == second


def _with_output(prompt: list[int], output: list[int], **params: Any) -> Request:
    r = Request("r", prompt, SamplingParams(**params), 8, TextStream(None, []), seed=7)  # type: ignore[arg-type]
    r.token_ids += output
    return r


def _processed(logits: torch.Tensor, requests: list[Request], eos: tuple[int, ...] = ()) -> torch.Tensor:
    from kvserve.engine.sampler import _process

    return _process(logits, requests, eos)


def test_penalties_match_their_definitions_row_by_row() -> None:
    """OpenAI's presence and frequency penalties on generated tokens, vLLM's repetition penalty on prompt
    and generated tokens; a row that asks for none is left exactly as it was."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]] * 3)
    rows = [
        _with_output([0], [3, 3, 2], presence_penalty=0.5, frequency_penalty=0.25),
        _with_output([0], [3, 1], repetition_penalty=2.0),
        _with_output([0], [3, 3]),
    ]
    out = _processed(logits, rows)
    torch.testing.assert_close(out[0], torch.tensor([2.0, -1.0, 0.5 - 0.75, 3.0 - 1.0, 1.0]))
    torch.testing.assert_close(out[1], torch.tensor([1.0, -2.0, 0.5, 1.5, 1.0]))
    assert torch.equal(out[2], logits[2])
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]] * 3)), "the input was changed"


def test_logit_bias_and_min_tokens() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]] * 2)
    biased = _with_output([0], [], logit_bias={1: 10.0, 3: -5.0})
    held = _with_output([0], [4], min_tokens=3, stop_token_ids=[2], max_tokens=8)
    out = _processed(logits, [biased, held], eos=(3,))
    torch.testing.assert_close(out[0], torch.tensor([2.0, 9.0, 0.5, -2.0, 1.0]))
    assert out[1, 2] == out[1, 3] == float("-inf") and out[1, 0] == 2.0
    assert sample(logits[:1], [held], (3,)) == [0]
    # Once min_tokens are out, the stop tokens come back.
    held.token_ids += [4, 4]
    assert sample(logits[:1], [held], (3,)) == [3]
    # ignore_eos: the end-of-sequence token is not a stop, so min_tokens does not hold it back.
    assert sample(logits[:1], [_with_output([0], [], min_tokens=3, ignore_eos=True)], (3,)) == [3]
