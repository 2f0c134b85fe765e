"""Linear layers in every weight precision: a row's output does not depend on the rest of its batch.

Cache transparency (a request's greedy tokens are the same alone or in any batch) needs each token's
output row to be a function of that row alone. Random weights of SmolLM2-135M's shapes; inputs with
per-row scales from 0.01 to 100 and one all-zero row, as hidden states have.
"""

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from kvserve.config import default_cache_dir
from kvserve.model.linear import Float32Linear, Fp16Linear, Int8Linear, Linear, make_linear
from kvserve.model.quant_blocks import Q4_0, Q4_1, Q8_0, QuantizedWeight
from kvserve.model.quant_linear import QuantLinear, make_block_linear

# (in, out) of the default model's products: qkv, o, gate and up, down, and the tied lm_head.
SHAPES = {
    "qkv": (576, 960),
    "o": (576, 576),
    "gate_up": (576, 1536),
    "down": (1536, 576),
    "lm_head": (576, 49152),
}
ROWS = 1000
# Rows computed alone, then compared inside batches: the first 64 (every batch of 2..64 holds a prefix of
# them) and the last 64 of the 1000-row batch.
PROBES = list(range(64)) + list(range(ROWS - 64, ROWS))

Compare = Callable[[torch.Tensor, torch.Tensor], None]


def bitwise(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(actual, expected), f"max difference {(actual - expected).abs().max().item():.3g}"


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-3)


# float32 is checked with allclose only: oneDNN (like F.linear) takes another kernel for one row than for
# a batch, so the last bits of a row change with the batch size. The low-precision modes are exact.
MODES: dict[str, Compare] = {
    "float32": close,
    "float16": bitwise,
    "int8": bitwise,
    "q8_0": bitwise,
    "gguf-Q8_0": bitwise,
    "gguf-Q4_0": bitwise,
    "gguf-Q4_1": bitwise,
    # int16 activations.
    "q8_0/int16": bitwise,
    "gguf-Q8_0/int16": bitwise,
    "gguf-Q4_0/int16": bitwise,
    "gguf-Q4_1/int16": bitwise,
}
GGUF_TYPES = {"gguf-Q8_0": Q8_0, "gguf-Q4_0": Q4_0, "gguf-Q4_1": Q4_1}
BLOCK_MODES = {"q8_0", *GGUF_TYPES}


def build(mode: str, w: torch.Tensor, b: torch.Tensor | None) -> Linear:
    """`mode`'s Linear; "gguf-<type>" runs blocks made by the gguf package's own quantizer, and
    "<mode>/int16" takes every row with int16 activations."""
    int16 = mode.endswith("/int16")
    mode = mode.removesuffix("/int16")
    if mode == "q8_0":
        return make_block_linear(w, b, None, "q8_0", default_cache_dir(), int16)
    if mode in GGUF_TYPES:
        import numpy as np
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        data = quantize(w.numpy(), GGMLQuantizationType(GGUF_TYPES[mode]))
        blocks = QuantizedWeight(GGUF_TYPES[mode], torch.from_numpy(np.ascontiguousarray(data)), w.shape[1])
        return QuantLinear(blocks, b, default_cache_dir(), int16=int16)
    return make_linear(w, b, mode)


def weights(n_in: int, n_out: int, bias: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n_out, n_in, generator=gen) * 0.05
    return w, torch.randn(n_out, generator=gen) * 0.1 if bias else None


def inputs(n_in: int, rows: int = ROWS, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n_in, generator=gen)
    x *= torch.logspace(-2, 2, rows)[torch.randperm(rows, generator=gen)].unsqueeze(1)
    x[5] = 0
    return x


def assert_row_invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, same: Compare) -> None:
    alone = torch.cat([fn(x[i : i + 1]) for i in PROBES])
    for size in range(2, 65):
        same(fn(x[:size]), alone[:size])
    same(fn(x)[PROBES], alone)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_row_alone_equals_the_same_row_in_any_batch(mode: str, shape: str) -> None:
    n_in, n_out = SHAPES[shape]
    w, b = weights(n_in, n_out, bias=shape != "lm_head")
    linear = build(mode, w, b)
    assert_row_invariant(linear, inputs(n_in), MODES[mode])


@pytest.mark.parametrize("mode", sorted(MODES))
def test_fused_ops_are_the_op_after_the_product_and_row_invariant(mode: str) -> None:
    same = MODES[mode]
    up = build(mode, *weights(576, 1536, bias=False))
    down = build(mode, *weights(1536, 576, bias=True, seed=2))
    x = inputs(576, rows=200)
    gate = inputs(1536, rows=200, seed=3)
    residual = inputs(576, rows=200, seed=4)
    # The native kernel's silu (silu_rows) has its own polynomial exp, torch its exp: within 2 ulp.
    (close if mode.removesuffix("/int16") in BLOCK_MODES else same)(up.silu(x), F.silu(up(x)))
    same(up.mul(x, gate), up(x) * gate)
    same(down.add(gate, residual), down(gate) + residual)
    for size in (1, 2, 7, 33, 200):
        same(up.silu(x[:size]), up.silu(x)[:size])
        same(up.mul(x[:size], gate[:size]), up.mul(x, gate)[:size])
        same(down.add(gate[:size], residual[:size]), down.add(gate, residual)[:size])


@pytest.mark.parametrize(("mode", "rtol"), [("float16", 2e-3), ("int8", 3e-2)])
def test_low_precision_products_stay_close_to_float32(mode: str, rtol: float) -> None:
    w, b = weights(576, 1536, bias=True)
    x = inputs(576, rows=64)
    exact = F.linear(x.double(), w.double(), b.double() if b is not None else None)
    error = (make_linear(w, b, mode)(x).double() - exact).norm(dim=1) / exact.norm(dim=1)
    assert error.max() < rtol


def test_make_linear_builds_the_mode_asked() -> None:
    w, b = weights(64, 32, bias=True)
    kinds: dict[str, type[Linear]] = {"float32": Float32Linear, "float16": Fp16Linear, "int8": Int8Linear}
    for mode, kind in kinds.items():
        assert type(make_linear(w, b, mode)) is kind
    with pytest.raises(ValueError, match="weight_dtype"):
        make_linear(w, b, "int4")


def test_off_the_cpu_float32_path_float16_rounds_the_weights_and_int8_is_refused() -> None:
    w, _ = weights(64, 32, bias=False)
    for other in (w.bfloat16(), w.to("meta")):
        fallback = make_linear(other, None, "float16")
        assert isinstance(fallback, Float32Linear)
        assert fallback.weight.dtype == other.dtype and fallback.weight.device == other.device
        with pytest.raises(ValueError, match="int8"):
            make_linear(other, None, "int8")
    rounded = make_linear(w.bfloat16(), None, "float16")
    assert isinstance(rounded, Float32Linear)
    assert torch.equal(rounded.weight, w.bfloat16().half().bfloat16())


def test_gelu_tanh_is_the_same_bits_on_any_thread_count_and_any_rows() -> None:
    """The block products' gelu (the native decoder's `gelu_tanh_rows`) splits a prefill's elements
    among the threads: every thread count and every row count gives a row the same bits."""
    up = build("gguf-Q4_0/int16", *weights(576, 1536, bias=False))
    assert isinstance(up, QuantLinear)
    x = inputs(576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = up.gelu_tanh(x)
        torch.set_num_threads(2)
        two = up.gelu_tanh(x)
        alone = torch.cat([up.gelu_tanh(x[i : i + 1]) for i in PROBES])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one.view(torch.int32), two.view(torch.int32))
    assert torch.equal(two[PROBES].view(torch.int32), alone.view(torch.int32))
    torch.testing.assert_close(two, F.gelu(up(x), approximate="tanh"), rtol=1e-5, atol=1e-6)
