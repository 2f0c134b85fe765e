"""The native decoder (every layer of a decode-only step in one call) gives the per-op path's bits."""

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.model.loader import LoadedModel
from kvserve.model.runner import ForwardBatch, ModelRunner, SequenceChunk
from tests.helpers import prefilled_decodes


@pytest.mark.parametrize("int16", [False, True], ids=["float32 decodes", "int16 decodes"])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "q8_0"])
def test_a_decode_step_through_the_native_decoder_equals_the_per_op_path(
    request: pytest.FixtureRequest, kv_dtype: str, int16: bool
) -> None:
    """Logits and the K/V written into the cache, bit for bit, for decodes of different lengths. With a
    q8_0 cache the decoder quantizes in C and the per-op path in torch: the same blocks, byte for byte,
    so a decode's cached K/V is what a prefill of its token would have written (q8_0 needs heads of a
    multiple of 32: its own tiny model)."""
    model: LoadedModel = request.getfixturevalue("tiny_q8_model" if kv_dtype == "q8_0" else "tiny_model")
    runner = ModelRunner(
        model, 64, 4, 256, "cpu", "float32", "q8_0", "native", kv_dtype=kv_dtype, int16_decodes=int16
    )
    decoder = runner.transformer.decoder
    assert decoder is not None
    decodes = prefilled_decodes(runner, [5, 41, 18], seed=11)
    k0, v0 = runner.kv_cache.k.clone(), runner.kv_cache.v.clone()
    fused = runner.execute(ForwardBatch(decodes=list(decodes))).sampled
    k1, v1 = runner.kv_cache.k.clone(), runner.kv_cache.v.clone()
    assert not torch.equal(k1, k0)
    runner.kv_cache.k.copy_(k0)
    runner.kv_cache.v.copy_(v0)
    runner.transformer.decoder = None
    per_op = runner.execute(ForwardBatch(decodes=list(decodes))).sampled
    assert torch.equal(fused, per_op)
    assert torch.equal(runner.kv_cache.k, k1) and torch.equal(runner.kv_cache.v, v1)


@pytest.mark.parametrize("int16", [False, True], ids=["float32 decodes", "int16 decodes"])
def test_a_decode_through_the_native_decoder_is_batch_invariant(tiny_model: LoadedModel, int16: bool) -> None:
    runner = ModelRunner(tiny_model, 64, 4, 256, "cpu", "float32", "q8_0", "native", int16_decodes=int16)
    decodes = prefilled_decodes(runner, [30, 7, 52, 12], seed=5)
    batch = runner.execute(ForwardBatch(decodes=list(decodes))).sampled
    for i, d in enumerate(decodes):
        assert torch.equal(runner.execute(ForwardBatch(decodes=[d])).sampled[0], batch[i])


def test_the_default_model_decodes_through_the_native_decoder(default_model: LoadedModel) -> None:
    """The default GGUF (Q4_1 products, a Q8_0 head, a float16 cache) takes the native decoder, with the
    per-op path's bits."""
    runner = ModelRunner(default_model, 64, 16, 512, "cpu", "float32", "gguf", "auto", kv_dtype="float16")
    assert runner.transformer.decoder is not None
    prompt = list(range(100, 140))
    runner.execute(ForwardBatch(prefills=[SequenceChunk(prompt[:-1], 0, [0, 1, 2], False)]))
    step = ForwardBatch(decodes=[SequenceChunk(prompt[-1:], len(prompt) - 1, [0, 1, 2], True)])
    fused = runner.execute(step).sampled
    runner.transformer.decoder = None
    assert torch.equal(runner.execute(step).sampled, fused)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    block_size=st.sampled_from([1, 2, 3, 16]),
    lengths=st.lists(st.integers(2, 40), min_size=1, max_size=5),
    kv_dtype=st.sampled_from(["float32", "float16"]),
    seed=st.integers(0, 2**16),
)
def test_the_native_decoder_equals_the_per_op_path_for_any_block_size_and_scattered_tables(
    tiny_model: LoadedModel, block_size: int, lengths: list[int], kv_dtype: str, seed: int
) -> None:
    """Small and odd block sizes, blocks handed out in a shuffled order, a pool with no block to spare:
    the decoder's K/V writes and its attention read the same slots as the per-op path's."""
    rng = random.Random(seed)
    need = [-(-n // block_size) for n in lengths]
    blocks = list(range(sum(need)))
    rng.shuffle(blocks)
    tables = [blocks[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(lengths))]
    runner = ModelRunner(
        tiny_model, len(blocks), block_size, 64, "cpu", "float32", "q8_0", "native", kv_dtype=kv_dtype
    )
    assert runner.transformer.decoder is not None
    decodes = []
    for n, table in zip(lengths, tables, strict=True):
        ids = [rng.randrange(4096) for _ in range(n)]
        runner.execute(ForwardBatch(prefills=[SequenceChunk(ids[:-1], 0, table, False)]))
        decodes.append(SequenceChunk(ids[-1:], n - 1, table, True))
    k0, v0 = runner.kv_cache.k.clone(), runner.kv_cache.v.clone()
    fused = runner.execute(ForwardBatch(decodes=list(decodes))).sampled
    k1, v1 = runner.kv_cache.k.clone(), runner.kv_cache.v.clone()
    runner.kv_cache.k.copy_(k0)
    runner.kv_cache.v.copy_(v0)
    runner.transformer.decoder = None
    assert torch.equal(runner.execute(ForwardBatch(decodes=list(decodes))).sampled, fused)
    assert torch.equal(runner.kv_cache.k, k1) and torch.equal(runner.kv_cache.v, v1)


@pytest.mark.parametrize(("weight_dtype", "attention"), [("float16", "native"), ("q8_0", "torch")])
def test_without_native_products_and_attention_there_is_no_native_decoder(
    tiny_model: LoadedModel, weight_dtype: str, attention: str
) -> None:
    runner = ModelRunner(tiny_model, 8, 4, 32, "cpu", "float32", weight_dtype, attention)
    assert runner.transformer.decoder is None


def test_the_gguf_embedding_reads_the_files_blocks_with_the_float_rows_values(
    default_model: LoadedModel,
) -> None:
    """No float copy of the vocabulary stays resident under gguf weights: the lookup dequantizes the
    Q8_0 rows it needs, the same values as the float rows."""
    runner = ModelRunner(default_model, 8, 16, 64, "cpu", "float32", "gguf", "auto")
    transformer = runner.transformer
    assert transformer.embed is None and transformer.embed_blocks is not None
    ids = torch.tensor([0, 17, 4096, 49151, 17])
    expected = default_model.weights["model.embed_tokens.weight"][ids]
    assert torch.equal(transformer.embedding(ids), expected)
