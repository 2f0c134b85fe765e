"""The Gated DeltaNet layer against transformers' own Qwen3.5 layer on tiny random float32 weights, to 1e-5:
a prompt in one call, the same prompt in several calls carrying the state (cuts inside chunks and at
multiples of 64), decode steps one row at a time, several sequences of different lengths in one batch with
their own slots, and llama.cpp's tiled order of the value heads."""

from dataclasses import replace

import pytest
import torch

from kvserve.model.families import qwen3_5
from kvserve.model.gated_deltanet import GatedDeltaNet, gated_deltanet
from tests.model.deltanet_cases import (
    HIDDEN,
    Pool,
    kvserve_layer,
    llamacpp_layout,
    model_config,
    reference_layer,
    rows_of,
    run_in_calls,
    text_config,
    weights_of,
)

# Tiny layers: one thread avoids a hand-off per small op.
pytestmark = pytest.mark.usefixtures("one_thread")


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def layers() -> tuple[object, GatedDeltaNet]:
    hf = text_config()
    reference = reference_layer(hf)
    return reference, kvserve_layer(hf, reference)


def expected(reference: object, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = reference(x.unsqueeze(0))  # type: ignore[operator]
    return out[0]


def prompt(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(length, HIDDEN, generator=torch.Generator().manual_seed(seed))


def test_a_prompt_in_one_call(layers: tuple[object, GatedDeltaNet]) -> None:
    reference, layer = layers
    x = prompt(150)
    pool = Pool.for_layer(layer)
    out = layer.forward(x, rows_of([150], [3]), pool.states)
    close(out, expected(reference, x))
    # Only the sequence's own slot holds a state.
    assert pool.delta[3].abs().sum() > 0 and pool.delta[:3].abs().sum() == 0 == pool.delta[4:].abs().sum()


@pytest.mark.parametrize("cuts", [[64], [128], [30, 64, 100], [1, 2, 3, 70], [63, 65, 129]])
def test_a_prompt_in_several_calls(layers: tuple[object, GatedDeltaNet], cuts: list[int]) -> None:
    reference, layer = layers
    x = prompt(150)
    whole, split = Pool.for_layer(layer), Pool.for_layer(layer)
    layer.forward(x, rows_of([150], [0]), whole.states)
    out = run_in_calls(layer, x, cuts, split, 0)
    close(out, expected(reference, x))
    close(split.delta, whole.delta)
    close(split.conv, whole.conv)


def test_decode_steps_one_row_at_a_time(layers: tuple[object, GatedDeltaNet]) -> None:
    reference, layer = layers
    x = prompt(80)
    out = run_in_calls(layer, x, list(range(70, 80)), Pool.for_layer(layer), 5)
    close(out, expected(reference, x))


def test_the_convolution_window_is_the_last_inputs(layers: tuple[object, GatedDeltaNet]) -> None:
    _, layer = layers
    x = prompt(10)
    pool = Pool.for_layer(layer)
    layer.forward(x, rows_of([10], [1]), pool.states)
    mixed = layer.qkv(x)
    torch.testing.assert_close(pool.conv[1], mixed[-3:].T)
    # A sequence shorter than the window keeps the older inputs in front of its own.
    layer.forward(x[:1], rows_of([1], [1]), pool.states)
    torch.testing.assert_close(pool.conv[1], torch.cat((mixed[-2:], mixed[:1])).T)


def test_sequences_of_different_lengths_in_one_batch(layers: tuple[object, GatedDeltaNet]) -> None:
    """Two decodes (of sequences with 20 and 70 rows before) in front, then prompts of 5, 64 and 130
    rows: each sequence's rows and state as when it runs alone."""
    reference, layer = layers
    histories = [prompt(21, seed=2), prompt(71, seed=3)]
    prompts = [prompt(5, seed=4), prompt(64, seed=5), prompt(130, seed=6)]
    pool = Pool.for_layer(layer)
    slots = [6, 2, 0, 7, 4]
    for history, slot in zip(histories, slots, strict=False):
        layer.forward(history[:-1], rows_of([history.shape[0] - 1], [slot]), pool.states)
    batch = [h[-1:] for h in histories] + prompts
    out = layer.forward(torch.cat(batch), rows_of([b.shape[0] for b in batch], slots), pool.states)
    start = 0
    for j, rows in enumerate(batch):
        full = histories[j] if j < 2 else rows
        want = expected(reference, full)[-rows.shape[0] :]
        close(out[start : start + rows.shape[0]], want)
        start += rows.shape[0]
        alone = Pool.for_layer(layer)
        layer.forward(full, rows_of([full.shape[0]], [slots[j]]), alone.states)
        close(pool.delta[slots[j]], alone.delta[slots[j]])
        close(pool.conv[slots[j]], alone.conv[slots[j]])


def test_value_heads_in_llamacpp_tiled_order(layers: tuple[object, GatedDeltaNet]) -> None:
    """The weights as llama.cpp's converter writes them (value heads tiled, A as -exp(A_log), the
    convolution [C, K]) give the same outputs."""
    reference, _ = layers
    hf = text_config()
    config = model_config(hf)
    assert config.deltanet is not None
    tiled = replace(config, deltanet=replace(config.deltanet, v_heads_tiled=True))
    gguf = llamacpp_layout(reference.state_dict(), hf)  # type: ignore[attr-defined]
    # Under the names the family maps llama.cpp's onto.
    names = {v: k for k, v in qwen3_5.GGUF_LAYER.items()}
    tensors = {k.removeprefix("linear_attn."): gguf[names[k]] for k in names if names[k] in gguf}
    layer = gated_deltanet(weights_of(tensors), tiled, "model.layers.0.")
    x = prompt(100)
    out = run_in_calls(layer, x, [70, 71], Pool.for_layer(layer), 0)
    close(out, expected(reference, x))


def test_the_family_sizes_the_state_as_the_layer_holds_it(layers: tuple[object, GatedDeltaNet]) -> None:
    _, layer = layers
    config = model_config(text_config())
    assert qwen3_5.state_spec(config, 0, torch.bfloat16) == layer.spec
    assert layer.spec.shapes == ((64, 3), (4, 8, 8)) and layer.spec.dtype == torch.float32
    with pytest.raises(ValueError, match="not a Gated DeltaNet layer"):
        qwen3_5.state_spec(config, 3, torch.float32)
