"""The native kernel on every weight type it reads, against the blocks' float values.

Blocks are random bytes (every bit pattern is a valid block) with sane float16 scale fields, or the gguf
package's own quantizer where it has one, so the kernel reads exactly what a GGUF file holds; the gguf
package's dequantization is the reference. Here: the rows dequantize to its values bit for bit, the
products are the float64 products of the dequantized weights up to summation order, the portable, AVX2
and AVX-512 paths give the same bits, each row is what it is alone, a product of parts of different types
is its parts run one by one, and the fused ops are the op after the product.
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
    BF16,
    BLOCK_SIZES,
    F16,
    F32,
    IQ4_XS,
    MXFP4,
    Q2_K,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    QK,
    TYPE_NAMES,
    QuantizedParts,
    QuantizedWeight,
    concat,
    quantize_q8_0,
    row_unit,
)
from kvserve.model.quant_linear import NativeRmsNorm, QuantLinear, make_block_linear

# Every type the kernels read, by name.
ALL = {TYPE_NAMES[t]: t for t in BLOCK_SIZES}
# The types the gguf package quantizes.
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


# Where each type keeps its float16 scales (d, and dmin or m) in a block: set to small finite values.
SCALE_FIELDS = {
    Q4_0: (0, 2),
    Q5_0: (0, 2),
    Q8_0: (0, 2),
    ALL["IQ4_NL"]: (0, 2),
    IQ4_XS: (0, 2),
    Q4_1: (0, 4),
    Q5_1: (0, 4),
    Q4_K: (0, 4),
    Q5_K: (0, 4),
    Q2_K: (80, 84),
    ALL["Q3_K"]: (108, 110),
    Q6_K: (208, 210),
}
# Where the quants of the types with offsets are (zeroed, a block holds its offsets alone).
QUANT_FIELDS: dict[int, list[tuple[int, int]]] = {
    Q4_1: [(4, 20)],
    Q5_1: [(4, 24)],
    Q4_K: [(16, 144)],
    Q5_K: [(16, 176)],
    Q2_K: [(16, 80)],
}


def random_blocks(qtype: int, n_out: int, n_in: int, seed: int = 0) -> QuantizedWeight:
    """n_out rows of random blocks of `qtype` with sane float16 scales (float types: random values)."""
    rng = np.random.default_rng(seed)
    elems, size = BLOCK_SIZES[qtype]
    if qtype in (F32, F16, BF16):
        values = rng.standard_normal((n_out, n_in)).astype(np.float32) * 0.05
        raw = (
            values.view(np.uint8)
            if qtype == F32
            else values.astype(np.float16).view(np.uint8)
            if qtype == F16
            else (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        )
        return QuantizedWeight(qtype, torch.from_numpy(np.ascontiguousarray(raw)), n_in)
    raw = rng.integers(0, 256, size=(n_out, n_in // elems, size), dtype=np.uint8)
    if qtype == MXFP4:
        # E8M0 scales 2^-10 .. 2^-2 (every byte is checked apart: test_every_mxfp4_scale_and_code...).
        raw[..., 0] = rng.integers(117, 126, size=raw.shape[:-1], dtype=np.uint8)
        return QuantizedWeight(qtype, torch.from_numpy(raw.reshape(n_out, -1)), n_in)
    start, stop = SCALE_FIELDS[qtype]
    halves = (stop - start) // 2
    scales = (rng.standard_normal((n_out, n_in // elems, halves)) * 0.01).astype(np.float16)
    raw[..., start:stop] = scales.view(np.uint8)
    return QuantizedWeight(qtype, torch.from_numpy(raw.reshape(n_out, -1)), n_in)


def row_lengths(qtype: int) -> list[int]:
    """Every row length the tests take for a type: 32-multiples 32..320, or 256, 512 and 768."""
    return [256, 512, 768] if row_unit(qtype) == 256 else list(range(32, 321, 32))


def reference(blocks: QuantizedWeight) -> torch.Tensor:
    values = dequantize(blocks.data.numpy(), GGMLQuantizationType(blocks.qtype))
    return torch.from_numpy(np.asarray(values, dtype=np.float32).reshape(blocks.out_features, -1))


@pytest.mark.parametrize("name", sorted(ALL))
def test_rows_dequantize_natively_to_the_gguf_package_values_bit_for_bit(name: str) -> None:
    qtype = ALL[name]
    for n_in in row_lengths(qtype):
        blocks = random_blocks(qtype, 7, n_in, seed=n_in)
        expected = reference(blocks)
        linear = QuantLinear(blocks, None, default_cache_dir())
        assert torch.equal(linear.rows(torch.arange(7)), expected), n_in
        assert torch.equal(linear.rows(torch.tensor([[3, 0], [6, 3]]))[1, 0], expected[6])
        assert torch.equal(blocks.dequantize(), expected)


def test_every_mxfp4_scale_and_code_dequantizes_to_the_gguf_package_values_bit_for_bit() -> None:
    """All 256 E8M0 scale bytes (subnormal halves for 0 and 1, 2^127 for 255) with all 16 codes in both
    nibbles; where the package's value overflows, so does the kernel's."""
    raw = np.zeros((256, 17), dtype=np.uint8)
    raw[:, 0] = np.arange(256)
    raw[:, 1:] = (np.arange(16, dtype=np.uint8) | (np.arange(16, dtype=np.uint8)[::-1] << 4))[None, :]
    blocks = QuantizedWeight(MXFP4, torch.from_numpy(raw), 32)
    with np.errstate(over="ignore"):
        expected = reference(blocks)
    assert torch.equal(QuantLinear(blocks, None, default_cache_dir()).rows(torch.arange(256)), expected)


@pytest.mark.parametrize("name", sorted(ALL))
@pytest.mark.parametrize("int16", [True, False])
def test_every_path_gives_the_same_bits_and_each_row_its_bits_alone(name: str, int16: bool) -> None:
    """Both activation modes; 131 outputs (the int16 tiles' 8- and 4-output tiles and three outputs one at a
    time, the float tiles' 32 column tiles and three outputs outside any). int16: 37 rows take two groups
    of 16 rows and a half group padded from 5 (AVX-512) or four halves and a padded one (AVX2), 9 one
    group (AVX-512) or a half and one row of the few-row tiles (AVX2), 3 the few-row tiles. float32:
    37 rows take the AVX-512 tiles (six 6-row tiles and a 1-row one) where the build has them, 9 the AVX2
    ones (eight rows, then one)."""
    qtype = ALL[name]
    for n_in in row_lengths(qtype)[:: 4 if row_unit(qtype) == QK else 2]:
        blocks = random_blocks(qtype, 131, n_in, seed=n_in)
        bias = torch.randn(131)
        paths = [
            QuantLinear(blocks, bias, default_cache_dir(), int16=int16, portable=p == 1, wide=p != 2)
            for p in (0, 2, 1)
        ]
        for n_rows in (37, 9, 3):
            x = rows(n_rows, n_in)
            out = paths[0](x)
            for other in paths[1:]:
                assert torch.equal(out, other(x)), (n_in, n_rows)
            for i in (0, n_rows // 2, n_rows - 1):
                assert torch.equal(out[i], paths[0](x[i : i + 1])[0])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_rows_property(data: st.DataObject) -> None:
    """Any type, width, batch and activation mode: the tiles a batch falls into (int16: few-row tiles, or
    groups of rows padded to 16, up to 4 or 5 rows past them in few-row tiles, row chunks sized to the L2
    cache; float32: eight, four or one rows per output, AVX-512 tiles of one to six rows, row chunks
    sized to the L1 cache) give the bits of the portable path and of each row alone."""
    qtype = ALL[data.draw(st.sampled_from(sorted(ALL)), label="type")]
    n_in = row_unit(qtype) * data.draw(st.integers(1, 60 if row_unit(qtype) == QK else 8), label="units")
    n_out = data.draw(st.integers(1, 40), label="outputs")
    n_rows = data.draw(st.integers(1, 60), label="rows")
    int16 = data.draw(st.booleans(), label="int16")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    gen = torch.Generator().manual_seed(seed)
    blocks = random_blocks(qtype, n_out, n_in, seed)
    bias = torch.randn(n_out, generator=gen)
    x = torch.randn(n_rows, n_in, generator=gen) * torch.logspace(-3, 3, n_rows).unsqueeze(1)
    fast = QuantLinear(blocks, bias, default_cache_dir(), int16=int16)
    out = fast(x)
    if fast.vectorized:
        for kw in ({"wide": False}, {"portable": True}):
            other = QuantLinear(blocks, bias, default_cache_dir(), int16=int16, **kw)
            assert torch.equal(out, other(x))
    for i in data.draw(st.lists(st.integers(0, n_rows - 1), min_size=1, max_size=4), label="probes"):
        assert torch.equal(out[i], fast(x[i : i + 1])[0])


@pytest.mark.parametrize("name", sorted(ALL))
@pytest.mark.parametrize("n_rows", [1, 4, 37])
def test_the_product_is_the_float_product_of_the_dequantized_weights(name: str, n_rows: int) -> None:
    qtype = ALL[name]
    n_in = 512 if row_unit(qtype) == 256 else 576
    blocks = random_blocks(qtype, 67, n_in)
    bias = torch.randn(67) * 0.1
    x = rows(n_rows, n_in)
    exact = F.linear(x.double(), reference(blocks).double(), bias.double())
    ours = QuantLinear(blocks, bias, default_cache_dir())(x).double()
    error = (ours - exact).norm(dim=1) / exact.norm(dim=1).clamp(min=1e-30)
    assert error.max() < 1e-6


@pytest.mark.parametrize("name", sorted(TYPES))
def test_blocks_the_gguf_package_quantizes_work_alike(name: str) -> None:
    w = random_weight(40, 96)
    blocks = gguf_blocks(w, TYPES[name])
    x = rows(3, 96)
    exact = F.linear(x.double(), reference(blocks).double())
    ours = QuantLinear(blocks, None, default_cache_dir())(x).double()
    assert ((ours - exact).norm(dim=1) / exact.norm(dim=1).clamp(min=1e-30)).max() < 1e-6


def test_a_product_of_parts_of_different_types_is_its_parts_run_one_by_one() -> None:
    """q, k and v as a Q4_K_M file gives them (Q5_0, Q4_K, Q6_K), with one bias over all three: one call
    writes each part's outputs at its columns, in both activation modes, with every fused op."""
    parts = [
        random_blocks(Q5_0, 37, 256, 1),
        random_blocks(Q4_K, 10, 256, 2),
        random_blocks(Q6_K, 21, 256, 3),
    ]
    joined = concat(parts)
    assert isinstance(joined, QuantizedParts) and joined.out_features == 68 and joined.qtype is None
    assert all(a.data is b.data for a, b in zip(joined.parts, parts, strict=True))
    bias = torch.randn(68)
    x, other = rows(9, 256), rows(9, 68, seed=2)
    for portable in (False, True):
        for int16 in (False, True):
            whole = QuantLinear(joined, bias, default_cache_dir(), int16=int16, portable=portable)
            ones = [
                QuantLinear(p, b, default_cache_dir(), int16=int16, portable=portable)
                for p, b in zip(parts, (bias[:37], bias[37:47], bias[47:]), strict=True)
            ]
            for n in (1, 9):
                assert torch.equal(whole(x[:n]), torch.cat([o(x[:n]) for o in ones], dim=1))
                split = (other[:n, :37], other[:n, 37:47], other[:n, 47:])
                assert torch.equal(
                    whole.add(x[:n], other[:n]),
                    torch.cat([o.add(x[:n], s) for o, s in zip(ones, split, strict=True)], dim=1),
                )
                assert torch.equal(whole.silu(x[:n]), torch.cat([o.silu(x[:n]) for o in ones], dim=1))
    index = torch.tensor([67, 0, 40, 37, 46, 47])
    assert torch.equal(whole.rows(index), joined.dequantize()[index])
    assert torch.equal(joined.dequantize(), torch.cat([reference(p) for p in parts]))


@pytest.mark.parametrize(
    ("qtype", "name"),
    [(16, "IQ2_XXS"), (19, "IQ1_S"), (21, "IQ3_S"), (35, "TQ2_0"), (40, "NVFP4"), (99, "99")],
)
def test_a_type_the_kernels_do_not_read_is_refused_by_name(qtype: int, name: str) -> None:
    with pytest.raises(ValueError, match=f"type {name}.* not read by kvserve"):
        QuantizedWeight(qtype, torch.zeros(2, 34, dtype=torch.uint8), 32)


@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "Q4_K", "F16"])
def test_fused_ops_are_the_op_after_the_product(name: str) -> None:
    blocks = random_blocks(ALL[name], 64, 256)
    linear = QuantLinear(blocks, torch.randn(64), default_cache_dir())
    x, other = rows(5, 256), rows(5, 64, seed=2)
    plain = linear(x)
    torch.testing.assert_close(linear.silu(x), F.silu(plain), rtol=1e-6, atol=1e-7)
    assert torch.equal(linear.add(x, other), plain + other)
    assert torch.equal(linear.mul(x, other), plain * other)


@pytest.mark.parametrize("int16", [True, False])
def test_the_thread_count_does_not_change_a_bit(int16: bool) -> None:
    blocks = gguf_blocks(random_weight(300, 576), Q4_1)
    linear = QuantLinear(blocks, None, default_cache_dir(), int16=int16)
    x = rows(21, 576)
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


def test_inputs_that_differ_do_not_concatenate_and_block_modes_fall_back() -> None:
    w = random_weight(32, 64)
    assert concat([gguf_blocks(w, Q8_0), gguf_blocks(random_weight(32, 96), Q8_0)]) is None
    # No blocks: "gguf" is float16. Another compute dtype: the blocks' values through F.linear.
    assert isinstance(make_block_linear(w, None, None, "gguf", default_cache_dir()), Fp16Linear)
    blocks = gguf_blocks(w, Q4_1)
    other = make_block_linear(w.double(), None, blocks, "gguf", default_cache_dir())
    assert isinstance(other, Float32Linear) and torch.equal(other.weight, blocks.dequantize().double())
    assert isinstance(make_block_linear(w, None, None, "q8_0", default_cache_dir()), QuantLinear)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedWeight(Q8_0, torch.zeros(2, 34, dtype=torch.uint8), 48)
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantizedWeight(Q4_K, torch.zeros(2, 72, dtype=torch.uint8), 128)
    with pytest.raises(ValueError, match="do not hold"):
        QuantizedWeight(Q8_0, torch.zeros(2, 35, dtype=torch.uint8), 32)
    linear = QuantLinear(gguf_blocks(random_weight(8, 64), Q8_0), None, default_cache_dir())
    with pytest.raises(ValueError, match="float32"):
        linear(torch.zeros(2, 64, dtype=torch.float64))
    with pytest.raises(IndexError):
        linear.rows(torch.tensor([8]))


def test_the_native_rms_norm_is_torchs_and_row_invariant() -> None:
    norm = NativeRmsNorm(default_cache_dir())
    x, weight = rows(33, 576), torch.randn(576)
    ours = norm(x, weight, 1e-5)
    torch.testing.assert_close(ours, F.rms_norm(x, (576,), weight, 1e-5), rtol=1e-5, atol=1e-6)
    assert torch.equal(torch.cat([norm(x[i : i + 1], weight, 1e-5) for i in range(33)]), ours)


def test_a_gguf_files_k_quant_and_q4_1_tensors_load_as_the_files_blocks(tmp_path: Any) -> None:
    """A tiny GGUF written with the gguf package: the loader hands each matrix over as the file's blocks
    with its own type (q rows put back in Hugging Face order, the other matrices the mapped bytes
    themselves), and the model layer runs both natively as they are."""
    from gguf import GGUFWriter

    from kvserve.model.families.llama import LLAMA
    from kvserve.model.gguf_file import open_gguf
    from kvserve.model.gguf_weights import GgufBlocks, GgufTensors
    from kvserve.model.weights import ModelWeights, Rows

    path = str(tmp_path / "tiny.gguf")
    writer = GGUFWriter(path, "llama")
    q_raw = random_blocks(Q4_K, 64, 256).data.numpy()
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
    assert isinstance(q_linear, QuantLinear) and q_linear.weight.qtype == Q4_K
    assert torch.equal(q_linear.rows(torch.arange(64)), expected)
    down_linear = weights.linear([Rows("model.layers.0.mlp.down_proj.weight", 16)], 64)
    assert isinstance(down_linear, QuantLinear) and down_linear.weight.qtype == Q4_1


# ---- int16 activations ---------------------------------------------------------------------------------


def q16_activations(x: torch.Tensor) -> torch.Tensor:
    """x [rows, n_in] as the kernel quantizes a row, dequantized: per block of 32, d = max|x| /
    32767 and q = x * (32767 / max|x|) rounded to nearest even, all in float32; returned as q * d in
    float64, the exact value the integer products stand for."""
    blocks = x.reshape(-1, QK)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(32767.0) / amax, torch.zeros(()))
    q = torch.round(blocks * inverse).clamp(-32767, 32767)
    return (q.double() * (amax / 32767.0).double()).reshape(x.shape)


def offsets(blocks: QuantizedWeight) -> torch.Tensor:
    """The offset part of each weight (0 for the types without one): the blocks with their quants
    zeroed. The kernel multiplies it by the exact float x, not the quantized one."""
    if blocks.qtype not in QUANT_FIELDS:
        return torch.zeros(blocks.out_features, blocks.in_features)
    size = BLOCK_SIZES[blocks.qtype][1]
    data = blocks.data.clone()
    view = data.view(blocks.out_features, -1, size)
    for start, stop in QUANT_FIELDS[blocks.qtype]:
        view[:, :, start:stop] = 0
    return reference(QuantizedWeight(blocks.qtype, data, blocks.in_features))


INTEGER = sorted(n for n, t in ALL.items() if t not in (F32, F16, BF16))


@pytest.mark.parametrize("name", INTEGER)
@pytest.mark.parametrize("n_rows", [1, 4, 37])
def test_int16_rows_are_the_product_of_their_quantized_activations(name: str, n_rows: int) -> None:
    blocks = random_blocks(ALL[name], 131, 512)
    bias = torch.randn(131) * 0.1
    linear = QuantLinear(blocks, bias, default_cache_dir(), int16=True)
    x = rows(n_rows, 512)
    ours = linear(x).double()
    m = offsets(blocks).double()
    x16 = q16_activations(x)
    exact = F.linear(x16, reference(blocks).double() - m, bias.double()) + F.linear(x.double(), m)
    error = (ours - exact).norm(dim=1) / exact.norm(dim=1).clamp(min=1e-30)
    assert error.max() < 1e-6
    # And within int16's rounding of the float product: 15 bits of each block's largest value.
    float_rows = F.linear(x.double(), reference(blocks).double(), bias.double())
    drift = (ours - float_rows).norm(dim=1) / float_rows.norm(dim=1).clamp(min=1e-30)
    assert drift.max() < 1e-4


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_float_types_run_their_rows_as_float_rows_in_int16_mode(name: str) -> None:
    blocks = random_blocks(ALL[name], 40, 128)
    x = rows(5, 128)
    exact = QuantLinear(blocks, None, default_cache_dir())(x)
    assert torch.equal(QuantLinear(blocks, None, default_cache_dir(), int16=True)(x), exact)


def test_decode_rows_are_no_different_from_prefill_rows_in_either_mode() -> None:
    """`decodes` changes nothing: a decode row and a prefill row of the same values have the same bits."""
    blocks = gguf_blocks(random_weight(64, 128), Q4_1)
    x = rows(5, 128)
    int16, exact = (QuantLinear(blocks, None, default_cache_dir(), int16=mode) for mode in (True, False))
    for linear in (int16, exact):
        assert torch.equal(linear(x, 5), linear(x)) and torch.equal(linear(x, 2), linear(x))
    assert not torch.equal(int16(x), exact(x))


@pytest.mark.parametrize("n_rows", [3, 9])
def test_a_non_finite_activation_makes_its_int16_row_not_finite(n_rows: int) -> None:
    blocks = gguf_blocks(random_weight(64, 128), Q8_0)
    linear = QuantLinear(blocks, None, default_cache_dir(), int16=True)
    x = rows(n_rows, 128)
    x[0, 40] = float("inf")
    x[1, 3] = float("nan")
    out = linear(x)
    assert not out[0].isfinite().any() and not out[1].isfinite().any() and out[2:].isfinite().all()
    if linear.vectorized:
        portable = QuantLinear(blocks, None, default_cache_dir(), int16=True, portable=True)
        assert torch.equal(out[2:], portable(x)[2:])


@pytest.fixture(scope="module")
def avx2_library() -> Any:
    """The products' library built without AVX-512 (-mno-avx512f, its own build key): the AVX2 tiles a
    machine without AVX-512 runs, on this one."""
    import dataclasses

    from kvserve.model.kernel_abi import LINEAR
    from kvserve.model.native_build import load_kernel

    flags = (*LINEAR.compile_flags, "-mno-avx512f")
    return load_kernel(dataclasses.replace(LINEAR, compile_flags=flags), default_cache_dir())


@pytest.mark.parametrize("int16", [True, False])
def test_a_build_without_avx512_gives_the_same_bits(avx2_library: Any, int16: bool) -> None:
    """Every type, rows of the one-row tiles, of one group and of several, in both activation modes."""
    for name in sorted(ALL):
        qtype = ALL[name]
        for n_in in row_lengths(qtype)[:: 5 if row_unit(qtype) == QK else 2]:
            blocks = random_blocks(qtype, 21, n_in, seed=n_in)
            bias = torch.randn(21)
            ours = QuantLinear(blocks, bias, default_cache_dir(), int16=int16)
            theirs = QuantLinear(blocks, bias, default_cache_dir(), int16=int16)
            theirs.lib = avx2_library
            for n_rows in (1, 3, 9, 37):
                x = rows(n_rows, n_in)
                assert torch.equal(ours(x), theirs(x)), (name, n_in, n_rows)


@pytest.mark.parametrize("name", sorted(n for n, t in ALL.items() if t not in (F32, F16, BF16)))
def test_few_int16_rows_have_the_portable_bits_on_every_path_alone_and_in_any_batch(
    avx2_library: Any, name: str
) -> None:
    """int16 batches of 1 to 33 rows: the few-row tiles (1 to 5 rows at a time with AVX-512, 4 with AVX2
    alone; below Q16_GROUP_MIN: 10 rows with AVX-512, 25 with AVX2 alone), then groups or half groups
    with the rows past them in the few-row tiles (8 + 4, 16 + 1..5, 24 + 1) or padded (8 + 5..7,
    16 + 6..15); 13 outputs (one 8-output
    tile and five one-output ones) and 7 (one-output tiles only). The build's tiles, its AVX2 tiles, a
    build without AVX-512 and the portable path all give each row the bits the portable path gives it
    alone, at the batch's start and at its end."""
    qtype = ALL[name]
    n_in = row_unit(qtype) * (3 if row_unit(qtype) == QK else 2)
    for n_out in (13, 7):
        blocks = random_blocks(qtype, n_out, n_in, seed=n_out)
        bias = torch.randn(n_out)
        paths = [
            QuantLinear(blocks, bias, default_cache_dir(), int16=True, **kw)
            for kw in ({}, {"wide": False}, {"portable": True}, {})
        ]
        paths[-1].lib = avx2_library
        x = rows(33, n_in)
        alone = torch.cat([paths[2](x[i : i + 1]) for i in range(33)])
        for n in range(1, 34):
            for start in sorted({0, 33 - n}):
                batch = x[start : start + n]
                for i, path in enumerate(paths):
                    assert torch.equal(path(batch), alone[start : start + n]), (n_out, n, start, i)
