"""The native decoder (every layer of a step in one call) gives the per-op path's bits.

For every family: random tiny configurations of each (q/k norms, post norms, GeGLU, biases, partial
rotary, NoPE layers, per-layer rope tables, sliding windows shorter than the context over shared or own
block ids, experts with top_k > 1), steps of decodes at different lengths and a prefill chunk with float32,
float16 and q8_0 caches: the hidden states and every K/V written are the per-op path's bit for bit.
KVSERVE_DECODER_CONFIGS=N draws N random configurations per family instead of the fixed one.
"""

import os
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.config import EngineConfig, default_cache_dir
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.loader import LoadedModel, load_model
from kvserve.model.runner import ForwardBatch, ModelRunner, SequenceChunk
from tests.helpers import prefilled_decodes, save_tiny_model


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
        model, 64, 4, 256, "cpu", "float32", "q8_0", "native", kv_dtype=kv_dtype, int16_activations=int16
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
    runner = ModelRunner(tiny_model, 64, 4, 256, "cpu", "float32", "q8_0", "native", int16_activations=int16)
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


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "smollm3", "phi3", "gemma3", "gpt_oss")
CONFIG_SEEDS = list(range(int(os.environ.get("KVSERVE_DECODER_CONFIGS", "1"))))
VOCAB = 512


def random_config(family: str, seed: int) -> dict[str, Any]:
    """A tiny configuration of `family` with every feature it has switched on, its sizes drawn from
    `seed`: heads of 32 (q8_0 caches quantize blocks of 32 along a head)."""
    rng = random.Random(f"{family}-{seed}")
    heads = rng.choice([2, 4])
    config: dict[str, Any] = {
        "hidden_size": 32 * heads,
        "num_attention_heads": heads,
        "num_key_value_heads": rng.choice([h for h in (1, 2, heads) if heads % h == 0]),
        "head_dim": 32,
        "intermediate_size": 32 * rng.choice([2, 3]),
        "num_hidden_layers": rng.choice([3, 4]),
        "vocab_size": VOCAB,
    }
    layers = config["num_hidden_layers"]
    window = rng.choice([2, 3, 5])
    if family == "llama":
        config.update(attention_bias=True, mlp_bias=True)
    elif family == "mistral":
        config.update(sliding_window=window)
    elif family == "qwen2":
        config.update(use_sliding_window=True, sliding_window=window, max_window_layers=1)
    elif family == "qwen3":
        config.update(attention_bias=True)
    elif family == "qwen3_moe":
        experts = rng.choice([4, 6])
        config.update(
            num_experts=experts,
            # Three ranks at least once: their sum's order shows.
            num_experts_per_tok=3 if seed == 0 else rng.choice([2, 3]),
            moe_intermediate_size=32,
            norm_topk_prob=rng.choice([True, False]),
            mlp_only_layers=[rng.randrange(layers)],
        )
    elif family == "smollm3":
        config.update(no_rope_layer_interval=2)
    elif family == "phi3":
        rotary = 16
        config.update(
            partial_rotary_factor=rotary / 32,
            original_max_position_embeddings=64,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0 + i / 4 for i in range(rotary // 2)],
                "long_factor": [1.5 + i for i in range(rotary // 2)],
            },
        )
    elif family == "gpt_oss":
        # Sinks, alternating sliding layers, the router's bias, the clamped SwiGLU (a limit that bites).
        config.update(
            sliding_window=window,
            num_local_experts=rng.choice([4, 6]),
            num_experts_per_tok=3 if seed == 0 else rng.choice([2, 3]),
            swiglu_limit=1.5,
        )
    elif family == "gemma3":
        types = ["sliding_attention", "full_attention"] * layers
        config.update(
            query_pre_attn_scalar=24,
            sliding_window=window,
            layer_types=types[:layers],
            rope_local_base_freq=100.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        )
    return config


@pytest.fixture(scope="module")
def model_of(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int], LoadedModel]:
    models: dict[tuple[str, int], LoadedModel] = {}

    def get(family: str, seed: int) -> LoadedModel:
        if (family, seed) not in models:
            folder = str(tmp_path_factory.mktemp(f"decoder-{family}-{seed}") / family)
            path = save_tiny_model(folder, family, **random_config(family, seed))
            models[family, seed] = load_model(path, default_cache_dir())
        return models[family, seed]

    return get


def caches(runner: ModelRunner) -> list[torch.Tensor]:
    kv = runner.kv_cache
    return [kv.k, kv.v, kv.sliding_k, kv.sliding_v]


@pytest.mark.parametrize("seed", CONFIG_SEEDS)
@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lengths=st.lists(st.integers(2, 24), min_size=2, max_size=4),
    block_size=st.sampled_from([2, 4, 16]),
    kv_dtype=st.sampled_from(["float32", "float16", "q8_0"]),
    int16=st.booleans(),
    own_sliding_ids=st.booleans(),
    chunk=st.integers(1, 24),
    order=st.randoms(use_true_random=False),
)
def test_a_step_through_the_native_decoder_equals_the_per_op_step(
    model_of: Callable[[str, int], LoadedModel],
    family: str,
    seed: int,
    lengths: list[int],
    block_size: int,
    kv_dtype: str,
    int16: bool,
    own_sliding_ids: bool,
    chunk: int,
    order: random.Random,
) -> None:
    """Decodes of several lengths and, where `chunk` > 1, the last sequence's last `chunk` tokens as a
    prefill chunk beside them (its whole prompt where it is that long): each token one row of the step."""
    model = model_of(family, seed)
    sliding = any(w is not None for w in model.config.windows)
    need = [-(-n // block_size) for n in lengths]
    blocks = list(range(sum(need)))
    order.shuffle(blocks)
    tables = [blocks[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(lengths))]
    # The sliding group's own ids: another arrangement of as many blocks.
    own = sliding and own_sliding_ids
    sliding_blocks = list(blocks)
    order.shuffle(sliding_blocks)
    sliding_tables = [sliding_blocks[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(lengths))]
    runner = ModelRunner(
        model,
        len(blocks),
        block_size,
        64,
        "cpu",
        "float32",
        "q8_0",
        "native",
        kv_dtype=kv_dtype,
        int16_activations=int16,
        num_sliding_blocks=len(blocks) if own else None,
    )
    transformer = runner.transformer
    decoder = transformer.decoder
    assert decoder is not None
    batch = ForwardBatch()
    for i, (n, table) in enumerate(zip(lengths, tables, strict=True)):
        ids = [order.randrange(VOCAB) for _ in range(n)]
        stable = sliding_tables[i] if own else None
        cut = max(0, n - chunk) if i == len(lengths) - 1 else n - 1
        if cut:
            prompt = SequenceChunk(ids[:cut], 0, table, False, sliding_table=stable)
            runner.execute(ForwardBatch(prefills=[prompt]))
        rows = SequenceChunk(ids[cut:], cut, table, True, sliding_table=stable)
        (batch.decodes if n - cut == 1 else batch.prefills).append(rows)
    before = [c.clone() for c in caches(runner)]
    step, positions, meta, _ = runner._inputs(batch)
    fused = transformer.forward(step, positions, meta, runner.kv_cache).clone()
    written = [c.clone() for c in caches(runner)]
    assert any(not torch.equal(w, b) for w, b in zip(written, before, strict=True))
    for cache, old in zip(caches(runner), before, strict=True):
        cache.copy_(old)
    transformer.decoder = None
    per_op = transformer.forward(step, positions, meta, runner.kv_cache)
    assert torch.equal(fused, per_op)
    for cache, expected in zip(caches(runner), written, strict=True):
        assert torch.equal(cache, expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_decodes_through_the_native_decoder(
    model_of: Callable[[str, int], LoadedModel], family: str
) -> None:
    runner = ModelRunner(model_of(family, 0), 8, 4, 32, "cpu", "float32", "q8_0", "auto")
    assert runner.transformer.decoder is not None


@pytest.mark.parametrize("family", FAMILIES)
def test_every_familys_engine_decodes_through_the_native_decoder_with_the_per_op_tokens(
    model_of: Callable[[str, int], LoadedModel], family: str
) -> None:
    """An engine of each family takes the native decoder (its sliding layers in a pool of their own,
    their blocks released behind the window as it slides), and its greedy replies are the per-op path's."""
    engine = Engine.from_config(
        EngineConfig(weight_dtype="q8_0", kv_cache_memory=2**22, enable_prefix_caching=False),
        model=model_of(family, 0),
    )
    transformer = engine.runner.transformer
    decoder = transformer.decoder
    assert decoder is not None
    prompts = [[(7 * i + 3 * j) % VOCAB for j in range(n)] for i, n in enumerate((9, 21))]

    def replies(tag: str) -> list[list[int]]:
        tokens: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(prompts))}
        for rid, prompt in zip(tokens, prompts, strict=True):
            engine.add_request(rid, prompt, SamplingParams(max_tokens=12, temperature=0))
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens[delta.request_id].extend(delta.token_ids)
        return list(tokens.values())

    fused = replies("native")
    transformer.decoder = None
    assert replies("per-op") == fused
