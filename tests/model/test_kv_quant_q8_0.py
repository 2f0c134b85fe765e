"""The q8_0 KV cache (llama.cpp's `-ctk q8_0` layout): the blocks' bytes, the round trip's error, the
attention kernel reading the blocks in place against a float64 reference, the native decoder's writes
equal to the per-op path's, the pool's size, and cache transparency through the engine."""

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.config import EngineConfig, default_cache_dir
from kvserve.engine.engine import Engine
from kvserve.errors import ConfigError
from kvserve.model import kv_quant
from kvserve.model.fingerprint import model_fingerprint
from kvserve.model.loader import LoadedModel
from kvserve.model.native_attention import PagedAttentionKernel
from kvserve.model.runner import ModelRunner, SequenceChunk
from tests.model.attention_cases import Case, cases, inputs, reference
from tests.model.test_kv_quant_float16 import chat_prompts, greedy

pytestmark = pytest.mark.usefixtures("one_thread")


def q8_kernel(dtype: torch.dtype) -> PagedAttentionKernel:
    return PagedAttentionKernel.load(default_cache_dir(), torch.device("cpu"), dtype, kv_quant.STORAGE)


@st.composite
def q8_cases(draw: st.DrawFn) -> Case:
    """The attention cases with head sizes of whole q8_0 blocks: 64 and 128 take the vector path, 32
    and 96 the generic rows."""
    return replace(draw(cases()), dim=draw(st.sampled_from([32, 64, 96, 128])))


def q8_inputs(case: Case, dtype: torch.dtype) -> dict[str, Any]:
    """`inputs` with the caches as q8_0 blocks (the NaN block stays NaN: its scales are)."""
    args = inputs(case, dtype)
    return dict(args, k_cache=kv_quant.quantize(args["k_cache"]), v_cache=kv_quant.quantize(args["v_cache"]))


def dequantized(args: dict[str, Any]) -> dict[str, Any]:
    """The same case over the values the q8_0 caches hold, for the float64 reference."""
    return dict(
        args,
        k_cache=kv_quant.dequantize(args["k_cache"], torch.float64),
        v_cache=kv_quant.dequantize(args["v_cache"], torch.float64),
    )


@settings(max_examples=60, deadline=None)
@given(case=q8_cases(), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_the_kernel_reads_q8_0_blocks_as_a_float64_reference_does(case: Case, dtype: torch.dtype) -> None:
    """Odd head sizes, grouped queries, windows and block sizes down to 1, rows of shared blocks."""
    args = q8_inputs(case, dtype)
    got = q8_kernel(dtype)(**args)
    assert got.dtype == dtype
    tolerance = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(
        got.double(), reference(dequantized(args), case), atol=tolerance, rtol=tolerance
    )


@settings(max_examples=15, deadline=None)
@given(case=q8_cases())
def test_a_row_over_a_q8_0_cache_is_bitwise_the_same_alone_or_in_a_batch(case: Case) -> None:
    args = q8_inputs(case, torch.float32)
    batch = q8_kernel(torch.float32)(**args)
    for r in range(len(case.lens)):
        alone = dict(
            args, q=args["q"][r : r + 1], tables=args["tables"][r : r + 1], lens=args["lens"][r : r + 1]
        )
        assert torch.equal(q8_kernel(torch.float32)(**alone)[0], batch[r])


def test_the_blocks_are_llama_cpps_q8_0_bytes() -> None:
    """The same bytes as the gguf package's Q8_0 quantizer (llama.cpp's reference in numpy), halves
    rounded away from zero, an all-zero block included."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 96, generator=gen) * torch.logspace(-4, 3, 40).unsqueeze(1)
    x[0] = 0
    # A block whose largest is 127 has d = 1: its other values land exactly on halves.
    x[1, :32] = torch.tensor([127.0] + [k + 0.5 for k in range(-16, 15)])
    ours = kv_quant.quantize(x).numpy()
    theirs = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(ours, theirs)


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    blocks=st.integers(1, 6),
    exponent=st.integers(-12, 14),
)
def test_the_round_trip_is_within_half_a_step_and_the_scales_rounding(
    seed: int, blocks: int, exponent: int
) -> None:
    """|x - dequantize(quantize(x))| <= d / 2 + 127 |d - float16(d)| per block: half a quantization step,
    plus the scale's float16 rounding carried to the largest quant."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, blocks * 32, generator=gen) * 2.0**exponent
    back = kv_quant.dequantize(kv_quant.quantize(x), torch.float64)
    assert back.shape == x.shape
    blocks_x = x.double().view(3, blocks, 32)
    d = blocks_x.abs().amax(dim=-1, keepdim=True) / 127
    # The slack: x * (1 / d) in float32 is x / d within 127 * 2 ulps, which may round either way.
    bound = d / 2 + 127 * (d - d.half().double()).abs() + 2e-5 * d
    assert ((blocks_x - back.view(3, blocks, 32)).abs() <= bound).all()


def test_values_q8_0_holds_come_back_bit_for_bit() -> None:
    """What a block holds (quants times a float16 scale) quantizes to the same block."""
    gen = torch.Generator().manual_seed(1)
    stored = kv_quant.quantize(torch.randn(7, 2, 64, generator=gen))
    values = kv_quant.dequantize(stored, torch.float32)
    assert torch.equal(kv_quant.quantize(values), stored)
    assert torch.equal(kv_quant.dequantize(kv_quant.quantize(values), torch.float32), values)


def test_a_head_size_that_is_no_multiple_of_32_is_refused_at_start(tiny_model: LoadedModel) -> None:
    config = EngineConfig(dtype="float64", weight_dtype="float32", kv_dtype="q8_0", kv_cache_memory=2**20)
    with pytest.raises(ConfigError, match="head_dim is 16, not a multiple of 32"):
        Engine.from_config(config, model=tiny_model)


def test_360_mib_hold_over_30000_tokens_of_the_default_model(make_engine: Callable[..., Engine]) -> None:
    """34 bytes per 32 values: 1.88x float16's tokens in the same memory."""
    memory = 360 * 2**20
    q8 = make_engine(kv_cache_memory=memory, kv_dtype="q8_0")
    assert q8.runner.kv_cache.k.dtype == torch.uint8
    tokens = q8.num_blocks * q8.config.block_size
    assert tokens >= 30_000
    half_blocks = memory // (16 * kv_quant.kv_bytes_per_token(q8.runner.transformer.config, "float16"))
    assert q8.num_blocks / half_blocks == pytest.approx(64 / 34, rel=2e-3)


def test_the_fingerprint_tells_q8_0_from_float16(default_model: LoadedModel) -> None:
    assert model_fingerprint(default_model, "gguf", "float32", 16, "q8_0") != model_fingerprint(
        default_model, "gguf", "float32", 16, "float16"
    )


@pytest.mark.parametrize("attention", ["native", "torch"])
def test_a_prefill_attends_to_the_values_the_cache_holds(tiny_q8_model: LoadedModel, attention: str) -> None:
    """A prompt's logits are the same whether its context was computed in the same chunk (first chunk:
    the portable backend attends to its fresh K/V) or read back from q8_0 blocks (continued chunks)."""
    ids = torch.randint(0, 4096, (37,), generator=torch.Generator().manual_seed(2)).tolist()
    table = list(range(10))

    def logits(cut: int) -> torch.Tensor:
        runner = ModelRunner(
            tiny_q8_model, 16, 4, 64, "cpu", "float64", "float32", attention, kv_dtype="q8_0"
        )
        first = runner.prefill_logits(SequenceChunk(ids[:cut], 0, table, False))
        rest = runner.prefill_logits(SequenceChunk(ids[cut:], cut, table, False))
        return torch.cat((first, rest))

    whole = logits(len(ids) - 1)
    torch.testing.assert_close(logits(9), whole, atol=1e-9, rtol=1e-9)


def test_both_backends_read_the_same_q8_0_values(tiny_q8_model: LoadedModel) -> None:
    ids = torch.randint(0, 4096, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    out = []
    for attention in ("native", "torch"):
        runner = ModelRunner(
            tiny_q8_model, 16, 4, 64, "cpu", "float64", "float32", attention, kv_dtype="q8_0"
        )
        first = runner.prefill_logits(SequenceChunk(ids[:20], 0, list(range(8)), False))
        out.append(
            torch.cat((first, runner.prefill_logits(SequenceChunk(ids[20:], 20, list(range(8)), False))))
        )
    torch.testing.assert_close(out[0], out[1], atol=1e-9, rtol=1e-9)


def test_q8_0_kv_keeps_the_cache_transparent(
    make_engine: Callable[..., Engine], default_model: LoadedModel
) -> None:
    """Cold and warm runs give the same greedy tokens: the later prompts read their shared prefix from
    q8_0 blocks (written by prefills and decodes) or compute it again, token for token alike."""
    prompts = chat_prompts(default_model)
    cached_engine = make_engine(kv_dtype="q8_0")
    cached = greedy(cached_engine, prompts, 24)
    assert cached_engine.kv.cached_prefix_len("", prompts[2]) >= cached_engine.config.block_size
    # The first prompt again, now all in the cache: its warm reply is its cold one.
    assert greedy(cached_engine, prompts[:1], 24) == cached[:1]
    assert cached == greedy(make_engine(kv_dtype="q8_0", enable_prefix_caching=False), prompts, 24)
