"""The native kernel on GGUF's quantized blocks (Q8_0, Q4_0, Q4_1) against the blocks' float values.

Blocks are made with the gguf package's own quantizer, so the kernel reads exactly what a GGUF file
holds. A row's output is checked bitwise across batches in
tests/model/test_linear_rows_batch_invariant.py; here: the products are the float32 products of the
dequantized weights (up to summation order), the AVX2 path and the portable path give the same bits, and
the fused ops are the op after the product.
"""

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.config import default_cache_dir
from kvserve.model.linear import Float32Linear, Fp16Linear
from kvserve.model.quant_blocks import (
    K8,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_0,
    QK,
    QuantizedWeight,
    concat,
    from_k_quant,
    quantize_q8_0,
)
from kvserve.model.quant_linear import NativeRmsNorm, QuantLinear, make_block_linear

TYPES = {"Q8_0": Q8_0, "Q4_0": Q4_0, "Q4_1": Q4_1}


def gguf_blocks(w: torch.Tensor, qtype: int) -> QuantizedWeight:
    data = quantize(w.numpy(), GGMLQuantizationType(qtype))
    return QuantizedWeight(qtype, torch.from_numpy(np.ascontiguousarray(data)), w.shape[1])


def random_weight(n_out: int, n_in: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n_out, n_in, generator=gen) * 0.05


def rows(n: int, n_in: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n_in, generator=gen) * torch.logspace(-2, 2, n).unsqueeze(1)
    x[n // 2] = 0
    return x


@pytest.mark.parametrize("name", sorted(TYPES))
def test_blocks_dequantize_to_the_gguf_package_values(name: str) -> None:
    w = random_weight(40, 96)
    blocks = gguf_blocks(w, TYPES[name])
    expected = dequantize(blocks.data.numpy(), GGMLQuantizationType(TYPES[name]))
    assert torch.equal(blocks.dequantize(), torch.from_numpy(np.asarray(expected, dtype=np.float32)))
    assert torch.equal(blocks.rows(torch.tensor([[3, 0], [39, 3]]))[1, 0], blocks.dequantize()[39])


@pytest.mark.parametrize("name", sorted(TYPES))
@pytest.mark.parametrize("n_rows", [1, 3, 4, 37])
def test_the_product_is_the_float_product_of_the_dequantized_blocks(name: str, n_rows: int) -> None:
    w = random_weight(203, 576)
    bias = torch.randn(203) * 0.1
    blocks = gguf_blocks(w, TYPES[name])
    x = rows(n_rows, 576)
    exact = F.linear(x.double(), blocks.dequantize().double(), bias.double())
    ours = QuantLinear(blocks, bias, default_cache_dir())(x).double()
    error = (ours - exact).norm(dim=1) / exact.norm(dim=1).clamp(min=1e-30)
    assert error.max() < 1e-6


@pytest.mark.parametrize("name", sorted(TYPES))
def test_the_vector_path_and_the_portable_path_give_the_same_bits(name: str) -> None:
    w = random_weight(131, 1536)
    blocks = gguf_blocks(w, TYPES[name])
    fast = QuantLinear(blocks, None, default_cache_dir())
    if not fast.vectorized:
        pytest.skip("this CPU has no AVX2 path to compare")
    portable = QuantLinear(blocks, None, default_cache_dir(), portable=True)
    x = rows(9, 1536)
    assert torch.equal(fast(x), portable(x))
    assert torch.equal(fast.silu(x), portable.silu(x))


@pytest.mark.parametrize("name", [*sorted(TYPES), "K8"])
@pytest.mark.parametrize("n_rows", [9, 37])
def test_the_avx512_and_avx2_tiles_and_the_portable_path_give_the_same_bits(name: str, n_rows: int) -> None:
    # 131 outputs: 32 column groups and three outputs outside any; 37 rows: six 6-row tiles and a 1-row
    # one; 9 rows stay on the AVX2 tiles (eight rows, then one). Where the build has no AVX-512 tiles,
    # both vector runs take the AVX2 ones.
    if name == "K8":
        blocks = from_k_quant(k_quant_blocks(torch.zeros(131, 512), Q4_K), Q4_K, 512)
    else:
        blocks = gguf_blocks(random_weight(131, 512), TYPES[name])
    wide = QuantLinear(blocks, torch.randn(131), default_cache_dir())
    if not wide.vectorized:
        pytest.skip("this CPU has no AVX2 path to compare")
    narrow = QuantLinear(blocks, wide.bias, default_cache_dir(), wide=False)
    portable = QuantLinear(blocks, wide.bias, default_cache_dir(), portable=True)
    x = rows(n_rows, 512)
    assert torch.equal(wide(x), narrow(x))
    assert torch.equal(wide(x), portable(x))
    assert torch.equal(wide(x)[n_rows - 1], wide(x[n_rows - 1 :])[0])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_float_rows_property(data: st.DataObject) -> None:
    """Any type (K8 too), width and batch: the tiles a batch falls into (eight, four or one rows per output,
    AVX-512 groups of one to six rows, row chunks sized to the L1 cache for wide inputs) give the bits of
    the portable path and of each row alone."""
    name = data.draw(st.sampled_from([*sorted(TYPES), "K8"]), label="type")
    n_blocks = data.draw(st.integers(1, 60), label="blocks")
    # K-quant super-blocks hold 256 weights.
    n_in = 256 * -(-n_blocks // 8) if name == "K8" else 32 * n_blocks
    n_out = data.draw(st.integers(1, 40), label="outputs")
    n_rows = data.draw(st.integers(1, 60), label="rows")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n_out, n_in, generator=gen) * 0.05
    if name == "K8":
        blocks = from_k_quant(k_quant_blocks(w, Q6_K), Q6_K, n_in)
    else:
        blocks = gguf_blocks(w, TYPES[name])
    bias = torch.randn(n_out, generator=gen)
    x = torch.randn(n_rows, n_in, generator=gen) * torch.logspace(-3, 3, n_rows).unsqueeze(1)
    fast = QuantLinear(blocks, bias, default_cache_dir())
    out = fast(x)
    if fast.vectorized:
        assert torch.equal(out, QuantLinear(blocks, bias, default_cache_dir(), wide=False)(x))
        assert torch.equal(out, QuantLinear(blocks, bias, default_cache_dir(), portable=True)(x))
    for i in data.draw(st.lists(st.integers(0, n_rows - 1), min_size=1, max_size=4), label="probes"):
        assert torch.equal(out[i], fast(x[i : i + 1])[0])


@pytest.mark.parametrize("name", sorted(TYPES))
def test_fused_ops_are_the_op_after_the_product(name: str) -> None:
    blocks = gguf_blocks(random_weight(64, 128), TYPES[name])
    linear = QuantLinear(blocks, torch.randn(64), default_cache_dir())
    x, other = rows(5, 128), rows(5, 64, seed=2)
    plain = linear(x)
    torch.testing.assert_close(linear.silu(x), F.silu(plain), rtol=1e-6, atol=1e-7)
    assert torch.equal(linear.add(x, other), plain + other)
    assert torch.equal(linear.mul(x, other), plain * other)


def test_the_thread_count_does_not_change_a_bit() -> None:
    blocks = gguf_blocks(random_weight(300, 576), Q4_1)
    linear = QuantLinear(blocks, None, default_cache_dir())
    x = rows(6, 576)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x)
        torch.set_num_threads(2)
        two = linear(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_q8_0_at_load_matches_ggml_quantization() -> None:
    w = random_weight(48, 256)
    w[3] = 0
    ours = quantize_q8_0(w)
    theirs = gguf_blocks(w, Q8_0)
    assert torch.equal(ours.dequantize(), theirs.dequantize())


def test_mixed_types_do_not_concatenate_and_block_modes_fall_back() -> None:
    w = random_weight(32, 64)
    assert concat([gguf_blocks(w, Q8_0), gguf_blocks(w, Q4_1)]) is None
    joined = concat([gguf_blocks(w, Q4_1), gguf_blocks(w, Q4_1)])
    assert joined is not None and joined.out_features == 64
    # No blocks: "gguf" is float16. Another compute dtype: the blocks' values through F.linear.
    assert isinstance(make_block_linear(w, None, None, "gguf", default_cache_dir()), Fp16Linear)
    blocks = gguf_blocks(w, Q4_1)
    other = make_block_linear(w.double(), None, blocks, "gguf", default_cache_dir())
    assert isinstance(other, Float32Linear) and torch.equal(other.weight, blocks.dequantize().double())
    assert isinstance(make_block_linear(w, None, None, "q8_0", default_cache_dir()), QuantLinear)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="whole blocks"):
        QuantizedWeight(Q8_0, torch.zeros(2, 34, dtype=torch.uint8), 48)
    with pytest.raises(ValueError, match="unsupported"):
        QuantizedWeight(99, torch.zeros(2, 34, dtype=torch.uint8), 32)
    linear = QuantLinear(gguf_blocks(random_weight(8, 64), Q8_0), None, default_cache_dir())
    with pytest.raises(ValueError, match="float32"):
        linear(torch.zeros(2, 64, dtype=torch.float64))


K_QUANTS = {"Q4_K": Q4_K, "Q5_K": Q5_K, "Q6_K": Q6_K}


def k_quant_blocks(w: torch.Tensor, qtype: int) -> np.ndarray:
    """Super-blocks as a GGUF holds them. The gguf package quantizes none of the K-quants, so random
    bytes stand in (every bit pattern is a valid block), with sane float16 scale fields."""
    rng = np.random.default_rng(qtype)
    n_out, n_in = w.shape
    size = {Q4_K: 144, Q5_K: 176, Q6_K: 210}[qtype]
    raw = rng.integers(0, 256, size=(n_out * n_in // 256, size), dtype=np.uint8)
    scales = (rng.random((raw.shape[0], 2)) * 0.01).astype(np.float16).view(np.uint8)
    if qtype == Q6_K:
        raw[:, 208:210] = scales[:, :2]
    else:
        raw[:, 0:4] = scales
    return raw.reshape(n_out, -1)


@pytest.mark.parametrize("name", sorted(K_QUANTS))
def test_k_quants_convert_to_k8_blocks_of_the_same_weights(name: str) -> None:
    qtype = K_QUANTS[name]
    raw = k_quant_blocks(torch.zeros(24, 512), qtype)
    converted = from_k_quant(raw, qtype, 512)
    expected = dequantize(raw, GGMLQuantizationType(qtype))
    assert torch.equal(converted.dequantize(), torch.from_numpy(np.asarray(expected, dtype=np.float32)))
    linear = QuantLinear(converted, None, default_cache_dir())
    x = rows(5, 512)
    exact = F.linear(x.double(), converted.dequantize().double())
    error = (linear(x).double() - exact).norm(dim=1) / exact.norm(dim=1).clamp(min=1e-30)
    assert error.max() < 1e-6
    if linear.vectorized:
        assert torch.equal(linear(x), QuantLinear(converted, None, default_cache_dir(), portable=True)(x))


def test_the_native_rms_norm_is_torchs_and_row_invariant() -> None:
    norm = NativeRmsNorm(default_cache_dir())
    x, weight = rows(33, 576), torch.randn(576)
    ours = norm(x, weight, 1e-5)
    torch.testing.assert_close(ours, F.rms_norm(x, (576,), weight, 1e-5), rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.cat([norm(x[i : i + 1], weight, 1e-5) for i in range(33)]), ours)


def test_a_gguf_files_k_quant_and_q4_1_tensors_load_as_blocks_of_the_same_weights(tmp_path: Any) -> None:
    """A tiny GGUF written with the gguf package: the loader hands each matrix over as the file's blocks
    with its own type (q rows put back in Hugging Face order, the other matrices the mapped bytes
    themselves); the model layer runs the Q4_K matrix as K8 blocks of the same weights and the Q4_1 one
    as it is."""
    from gguf import GGUFWriter

    from kvserve.model.families.llama import LLAMA
    from kvserve.model.gguf_file import open_gguf
    from kvserve.model.gguf_weights import GgufBlocks, GgufTensors
    from kvserve.model.weights import ModelWeights, Rows

    path = str(tmp_path / "tiny.gguf")
    writer = GGUFWriter(path, "llama")
    q_raw = k_quant_blocks(torch.zeros(64, 256), Q4_K)
    down = gguf_blocks(random_weight(16, 64), Q4_1)
    writer.add_tensor("blk.0.attn_q.weight", q_raw, raw_dtype=GGMLQuantizationType.Q4_K)
    writer.add_tensor("blk.0.ffn_down.weight", down.data.numpy(), raw_dtype=GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = open_gguf(path)
    blocks = GgufBlocks(GgufTensors(file, LLAMA, (4, 2)))
    q = blocks["model.layers.0.self_attn.q_proj.weight"]
    # llama.cpp's rows per head are (first half, second half) interleaved pairwise; Hugging Face's are not.
    stored = np.asarray(dequantize(q_raw, GGMLQuantizationType.Q4_K), dtype=np.float32)
    expected = torch.from_numpy(stored.reshape(4, 8, 2, 256).swapaxes(1, 2).reshape(64, 256).copy())
    assert q.qtype == Q4_K and q.in_features == 256 and torch.equal(q.dequantize(), expected)
    loaded_down = blocks["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(loaded_down.data, down.data)
    in_place = file.array(file.tensors["blk.0.ffn_down.weight"])
    assert loaded_down.data.data_ptr() == in_place.ctypes.data, "the blocks are the mapped bytes"
    weights = ModelWeights({}, blocks, torch.device("cpu"), torch.float32, "gguf", default_cache_dir(), False)
    q_linear = weights.linear([Rows("model.layers.0.self_attn.q_proj.weight", 64)], 256)
    assert isinstance(q_linear, QuantLinear) and q_linear.weight.qtype == K8
    assert torch.equal(q_linear.rows(torch.arange(64)), expected)
    down_linear = weights.linear([Rows("model.layers.0.mlp.down_proj.weight", 16)], 64)
    assert isinstance(down_linear, QuantLinear) and down_linear.weight.qtype == Q4_1


# ---- Decode rows with int16 activations -------------------------------------------------------------


def q16_activations(x: torch.Tensor) -> torch.Tensor:
    """x [rows, n_in] as the kernel quantizes a decode row, dequantized: per block of 32, d = max|x| /
    32767 and q = x * (32767 / max|x|) rounded to nearest even, all in float32; returned as q * d in
    float64, the exact value the integer products stand for."""
    blocks = x.reshape(-1, QK)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros(()))
    q = torch.round(blocks * inverse).clamp(-32767, 32767)
    return (q.double() * (amax / 32767.0).double()).reshape(x.shape)


def offsets(blocks: QuantizedWeight) -> torch.Tensor:
    """The offset part of each weight (Q4_1's m, K8's m; 0 for the types without one): the blocks with
    their quants zeroed. The kernel multiplies it by the exact float x, not the quantized one."""
    quants_at = {Q4_1: (4, 20), K8: (12, 44)}
    if blocks.qtype not in quants_at:
        return torch.zeros(blocks.out_features, blocks.in_features)
    start, size = quants_at[blocks.qtype]
    data = blocks.data.clone()
    view = data.view(blocks.out_features, -1, size)
    view[:, :, start:] = 0
    return QuantizedWeight(blocks.qtype, data, blocks.in_features).dequantize()


def all_blocks() -> dict[str, QuantizedWeight]:
    w = random_weight(131, 512)
    made = {name: gguf_blocks(w, qtype) for name, qtype in TYPES.items()}
    # From Q6_K: its sub-blocks of 16 give a K8 block two different scales (Q4_K's of 32 give one).
    made["K8"] = from_k_quant(k_quant_blocks(torch.zeros(131, 512), Q6_K), Q6_K, 512)
    return made


@pytest.mark.parametrize("name", [*sorted(TYPES), "K8"])
@pytest.mark.parametrize("n_rows", [1, 3, 4, 9])
def test_int16_rows_are_the_product_of_their_quantized_activations(name: str, n_rows: int) -> None:
    blocks = all_blocks()[name]
    bias = torch.randn(131) * 0.1
    linear = QuantLinear(blocks, bias, default_cache_dir(), int16_decodes=True)
    x = rows(n_rows, 512)
    ours = linear(x, n_rows).double()
    m = offsets(blocks).double()
    x16 = q16_activations(x)
    exact = F.linear(x16, blocks.dequantize().double() - m, bias.double()) + F.linear(x.double(), m)
    error = (ours - exact).norm(dim=1) / exact.norm(dim=1).clamp(min=1e-30)
    assert error.max() < 1e-6
    # And within int16's rounding of the float product: 15 bits of each block's largest value.
    float_rows = F.linear(x.double(), blocks.dequantize().double(), bias.double())
    drift = (ours - float_rows).norm(dim=1) / float_rows.norm(dim=1).clamp(min=1e-30)
    assert drift.max() < 1e-4


@pytest.mark.parametrize("name", [*sorted(TYPES), "K8"])
def test_int16_rows_are_the_same_on_every_path_and_in_any_batch(name: str) -> None:
    blocks = all_blocks()[name]
    fast = QuantLinear(blocks, torch.randn(131), default_cache_dir(), int16_decodes=True)
    portable = QuantLinear(blocks, fast.bias, default_cache_dir(), int16_decodes=True, portable=True)
    x = rows(9, 512)
    for decodes in (1, 4, 5, 9):
        mixed = fast(x, decodes)
        assert torch.equal(mixed, portable(x, decodes))
        # The first `decodes` rows are int16 rows, the rest float rows, each as it is alone.
        assert torch.equal(mixed[:decodes], fast(x[:decodes], decodes))
        assert torch.equal(mixed[decodes:], fast(x[decodes:]))
    alone = torch.cat([fast(x[i : i + 1], 1) for i in range(9)])
    assert torch.equal(fast(x, 9), alone)
    assert torch.equal(fast.silu(x, 9), portable.silu(x, 9))


def test_without_int16_decodes_every_row_is_a_float_row() -> None:
    blocks = gguf_blocks(random_weight(64, 128), Q4_1)
    linear = QuantLinear(blocks, None, default_cache_dir())
    x = rows(5, 128)
    assert torch.equal(linear(x, 5), linear(x))
    assert not torch.equal(
        QuantLinear(blocks, None, default_cache_dir(), int16_decodes=True)(x, 5), linear(x)
    )


def test_a_non_finite_activation_makes_its_int16_row_not_finite() -> None:
    blocks = gguf_blocks(random_weight(64, 128), Q8_0)
    linear = QuantLinear(blocks, None, default_cache_dir(), int16_decodes=True)
    x = rows(3, 128)
    x[0, 40] = float("inf")
    x[1, 3] = float("nan")
    out = linear(x, 3)
    assert not out[0].isfinite().any() and not out[1].isfinite().any() and out[2].isfinite().all()
    if linear.vectorized:
        portable = QuantLinear(blocks, None, default_cache_dir(), int16_decodes=True, portable=True)
        assert torch.equal(out[2], portable(x, 3)[2])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_int16_rows_property(data: st.DataObject) -> None:
    """Any type, shape, split of decode and float rows and scale of activations (tiny, huge, zero blocks,
    values that round to the int16 limits): the vector and portable paths agree bit for bit, and each
    row is what it is alone."""
    name = data.draw(st.sampled_from(sorted(TYPES)), label="type")
    n_in = 32 * data.draw(st.integers(1, 6), label="blocks")
    n_out = data.draw(st.integers(1, 70), label="outputs")
    n_rows = data.draw(st.integers(1, 9), label="rows")
    decodes = data.draw(st.integers(0, n_rows), label="decodes")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    gen = torch.Generator().manual_seed(seed)
    blocks = gguf_blocks(torch.randn(n_out, n_in, generator=gen) * 0.05, TYPES[name])
    scale = torch.tensor(
        data.draw(
            st.lists(st.sampled_from([0.0, 1e-30, 1e-3, 1.0, 1e3, 1e30]), min_size=n_rows, max_size=n_rows),
            label="scales",
        )
    )
    x = torch.randn(n_rows, n_in, generator=gen) * scale.unsqueeze(1)
    fast = QuantLinear(blocks, None, default_cache_dir(), int16_decodes=True)
    out = fast(x, decodes)
    if fast.vectorized:
        assert torch.equal(
            out, QuantLinear(blocks, None, default_cache_dir(), int16_decodes=True, portable=True)(x, decodes)
        )
    for i in range(n_rows):
        assert torch.equal(out[i], fast(x[i : i + 1], 1 if i < decodes else 0)[0])
