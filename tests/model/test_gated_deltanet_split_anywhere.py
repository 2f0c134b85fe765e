"""A sequence split into calls at any points (each call a chunked prefill, or a one-row step) gives the
outputs and the state of one call, to float32 tolerance: the state a call leaves is all the next needs."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model.gated_deltanet import GatedDeltaNet
from tests.model.deltanet_cases import (
    HIDDEN,
    Pool,
    kvserve_layer,
    reference_layer,
    rows_of,
    run_in_calls,
    text_config,
)

# Tiny layers: one thread avoids a hand-off per small op.
pytestmark = pytest.mark.usefixtures("one_thread")

# Each call's chunks round differently (a chunk reading a carried state cancels larger terms): against a
# float64 run, a split sequence's outputs (a few units) were seen 2e-5 off where one call's were 4e-6.
TOL = 5e-5
_LAYER: list[GatedDeltaNet] = []


def layer() -> GatedDeltaNet:
    if not _LAYER:
        hf = text_config()
        _LAYER.append(kvserve_layer(hf, reference_layer(hf, seed=3)))
    return _LAYER[0]


@st.composite
def splits(draw: st.DrawFn) -> tuple[int, list[int]]:
    length = draw(st.integers(min_value=1, max_value=200))
    cuts = draw(st.lists(st.integers(min_value=1, max_value=max(1, length - 1)), max_size=4, unique=True))
    return length, sorted(c for c in cuts if c < length)


@settings(max_examples=50, deadline=None)
@given(splits(), st.integers(min_value=0, max_value=2**16))
def test_splitting_a_sequence_anywhere_changes_nothing(split: tuple[int, list[int]], seed: int) -> None:
    length, cuts = split
    mixer = layer()
    x = torch.randn(length, HIDDEN, generator=torch.Generator().manual_seed(seed))
    whole, parts = Pool.for_layer(mixer, slots=2), Pool.for_layer(mixer, slots=2)
    expected = mixer.forward(x, rows_of([length], [1]), whole.states)
    out = run_in_calls(mixer, x, cuts, parts, 1)
    torch.testing.assert_close(out, expected, atol=TOL, rtol=TOL)
    torch.testing.assert_close(parts.delta, whole.delta, atol=TOL, rtol=TOL)
    torch.testing.assert_close(parts.conv, whole.conv, atol=TOL, rtol=TOL)
