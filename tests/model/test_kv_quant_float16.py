"""The float16 KV cache: half the bytes per cached token, read by every attention path as the same
rounded values, so that the cache stays transparent and the greedy replies stay float32's."""

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings

from kvserve.cli import build_parser, engine_config
from kvserve.config import EngineConfig, default_cache_dir
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.fingerprint import model_fingerprint
from kvserve.model.loader import LoadedModel
from kvserve.model.native_attention import PagedAttentionKernel
from tests.model.attention_cases import Case, cases, inputs, reference

pytestmark = pytest.mark.usefixtures("one_thread")


def half_kernel() -> PagedAttentionKernel:
    return PagedAttentionKernel.load(default_cache_dir(), torch.device("cpu"), torch.float32, torch.float16)


def half_cache_inputs(case: Case) -> dict[str, Any]:
    args = inputs(case, torch.float32)
    return dict(args, k_cache=args["k_cache"].half(), v_cache=args["v_cache"].half())


@settings(max_examples=30, deadline=None)
@given(case=cases())
def test_the_kernel_widens_a_float16_cache_and_sums_in_float32(case: Case) -> None:
    args = half_cache_inputs(case)
    got = half_kernel()(**args)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference(args, case), atol=2e-5, rtol=2e-5)


@settings(max_examples=15, deadline=None)
@given(case=cases())
def test_a_row_over_a_float16_cache_is_bitwise_the_same_alone_or_in_a_batch(case: Case) -> None:
    args = half_cache_inputs(case)
    batch = half_kernel()(**args)
    for r in range(len(case.lens)):
        alone = dict(
            args, q=args["q"][r : r + 1], tables=args["tables"][r : r + 1], lens=args["lens"][r : r + 1]
        )
        assert torch.equal(half_kernel()(**alone)[0], batch[r])


def test_auto_is_float16_under_float32_and_the_compute_dtype_otherwise() -> None:
    assert EngineConfig().kv_cache_dtype == "float16"
    assert EngineConfig(dtype="float64").kv_cache_dtype == "float64"
    assert EngineConfig(kv_dtype="float32").kv_cache_dtype == "float32"
    with pytest.raises(ValueError, match="kv_dtype"):
        EngineConfig(kv_dtype="int4")
    args = build_parser().parse_args(["serve", "--kv-dtype", "float32"])
    assert engine_config(args).kv_dtype == "float32"
    assert engine_config(build_parser().parse_args(["serve"])).kv_dtype == "auto"


def test_float16_holds_twice_the_tokens_in_the_same_bytes(make_engine: Callable[..., Engine]) -> None:
    # 30 float32 blocks of the default model (30 layers, 3 KV heads of 64, 16 tokens a block).
    memory = 30 * 2 * 30 * 3 * 64 * 4 * 16
    half = make_engine(kv_cache_memory=memory, kv_dtype="float16")
    full = make_engine(kv_cache_memory=memory, kv_dtype="float32")
    assert half.runner.kv_cache.k.dtype == torch.float16
    assert half.runner.kv_cache.k.shape[1] == 2 * full.runner.kv_cache.k.shape[1]


def test_the_fingerprint_tells_the_kv_dtypes_apart(default_model: LoadedModel) -> None:
    assert model_fingerprint(default_model, "gguf", "int16", 16, "float16") != model_fingerprint(
        default_model, "gguf", "int16", 16, "float32"
    )


def test_the_fingerprint_tells_the_activations_apart(default_model: LoadedModel) -> None:
    assert model_fingerprint(default_model, "gguf", "int16", 16, "float16") != model_fingerprint(
        default_model, "gguf", "float32", 16, "float16"
    )


def greedy(engine: Engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    out: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        # One at a time, so that a later prompt finds an earlier one's blocks in the cache.
        engine.add_request(str(i), prompt, params)
        while engine.has_unfinished_requests():
            for delta in engine.step():
                out.setdefault(delta.request_id, []).extend(delta.token_ids)
    return [out[str(i)] for i in range(len(prompts))]


def chat_prompts(model: LoadedModel) -> list[list[int]]:
    tok = model.tokenizer
    system = "You are a helpful assistant who answers in full sentences. "
    questions = ["What is the capital of France?", "Name three prime numbers.", "Why is the sky blue?"]
    return [tok.encode(system + q) for q in questions]


def test_float16_kv_keeps_the_float32_greedy_replies(
    make_engine: Callable[..., Engine], default_model: LoadedModel
) -> None:
    # Decode rows in float32, so that only the KV dtype differs: with int16 decodes as well, a near tie
    # on one of these replies falls the other way (their agreement rate is test_weight_dtype_quality's).
    prompts = chat_prompts(default_model)
    settings = {"enable_prefix_caching": False, "activations": "float32"}
    half = greedy(make_engine(kv_dtype="float16", **settings), prompts, 48)
    full = greedy(make_engine(kv_dtype="float32", **settings), prompts, 48)
    assert half == full


def test_float16_kv_keeps_the_cache_transparent(
    make_engine: Callable[..., Engine], default_model: LoadedModel
) -> None:
    """The prompts share a prefix: with the cache on, the later ones read it from float16 blocks; with
    it off, they compute it again. The replies are the same token for token."""
    prompts = chat_prompts(default_model)
    cached_engine = make_engine(kv_dtype="float16")
    cached = greedy(cached_engine, prompts, 24)
    assert cached_engine.kv.cached_prefix_len("", prompts[2]) >= cached_engine.config.block_size
    assert cached == greedy(make_engine(kv_dtype="float16", enable_prefix_caching=False), prompts, 24)
