"""The one-call native decoder against the per-op path on every family: random tiny configurations of
each (q/k norms, post norms, GeGLU, biases, partial rotary, NoPE layers, per-layer rope tables, sliding
windows shorter than the context over shared or own block ids, experts with top_k > 1), decode steps of
several rows at different lengths with float32, float16 and q8_0 caches: the hidden states and every
K/V written are the per-op path's bit for bit.

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

from kvserve.config import default_cache_dir
from kvserve.model.loader import LoadedModel, load_model
from kvserve.model.runner import ForwardBatch, ModelRunner, SequenceChunk
from tests.helpers import save_tiny_model

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "smollm3", "phi3", "gemma3")
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
    order=st.randoms(use_true_random=False),
)
def test_a_decode_step_through_the_native_decoder_equals_the_per_op_step(
    model_of: Callable[[str, int], LoadedModel],
    family: str,
    seed: int,
    lengths: list[int],
    block_size: int,
    kv_dtype: str,
    int16: bool,
    own_sliding_ids: bool,
    order: random.Random,
) -> None:
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
        int16_decodes=int16,
        num_sliding_blocks=len(blocks) if own else None,
    )
    transformer = runner.transformer
    decoder = transformer.decoder
    assert decoder is not None
    decodes = []
    for i, (n, table) in enumerate(zip(lengths, tables, strict=True)):
        ids = [order.randrange(VOCAB) for _ in range(n)]
        stable = sliding_tables[i] if own else None
        prompt = SequenceChunk(ids[:-1], 0, table, False, sliding_table=stable)
        runner.execute(ForwardBatch(prefills=[prompt]))
        decodes.append(SequenceChunk(ids[-1:], n - 1, table, True, sliding_table=stable))
    before = [c.clone() for c in caches(runner)]
    step, positions, meta, _ = runner._inputs(ForwardBatch(decodes=decodes))
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
