"""The sampler on its own: greedy, the filters, the distribution it draws from, and seeded reproducibility."""

from collections import Counter
from typing import Any

import pytest
import torch

from kvserve.engine.request import Request
from kvserve.engine.sampler import sample
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
