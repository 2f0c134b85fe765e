"""Qwen3-Next, Qwen3.5's predecessor: the same Gated DeltaNet and gated attention layers (qwen3_5.py), a
sparse MoE with a shared expert in every layer but `mlp_only_layers` (or off the `decoder_sparse_step`),
and the DeltaNet's input projections fused by key head: `in_proj_qkvz` holds, for each key head in turn,
its q rows, its k rows, then the v and the z rows of the value heads it groups; `in_proj_ba` the b and
the a rows of those value heads. They are read as Qwen3.5's four projections, row ranges of the fused
matrices (no copy; a GGUF's blocks would move whole)."""

from collections.abc import Mapping
from typing import Any

from kvserve.model.families.base import Family
from kvserve.model.families.qwen3_5 import (
    TENSORS,
    hybrid_config,
    shared_expert_mlp,
    state_spec,
    with_shared_expert,
)
from kvserve.model.families.qwen3_moe import moe_config
from kvserve.model.gated_deltanet import PREFIX, GatedDeltaNet, gated_deltanet
from kvserve.model.spec import ModelConfig, layer_count
from kvserve.model.weights import ModelWeights, Rows


def _config(raw: Mapping[str, Any]) -> ModelConfig:
    defaults = {"num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512}
    moe = with_shared_expert(raw, moe_config({**defaults, **raw}, layer_count(raw)))
    return hybrid_config(raw, "qwen3_next", moe=moe)


def fused_projections(config: ModelConfig, prefix: str) -> dict[str, list[Rows]]:
    """Qwen3.5's input projections as row ranges of Qwen3-Next's fused matrices, in Qwen3.5's order
    (q of every key head, then k, then v grouped by key head; z; b; a)."""
    c = config.deltanet
    assert c is not None
    per = c.num_v_heads // c.num_k_heads
    qkvz, ba = prefix + PREFIX + "in_proj_qkvz.weight", prefix + PREFIX + "in_proj_ba.weight"
    group = 2 * c.k_head_dim + 2 * per * c.v_head_dim

    def rows(name: str, total: int, width: int, start: int, size: int) -> list[Rows]:
        return [Rows(name, total, h * width + start, h * width + start + size) for h in range(c.num_k_heads)]

    def of_qkvz(start: int, size: int) -> list[Rows]:
        return rows(qkvz, c.num_k_heads * group, group, start, size)

    k, v = c.k_head_dim, per * c.v_head_dim
    return {
        "in_proj_qkv": of_qkvz(0, k) + of_qkvz(k, k) + of_qkvz(2 * k, v),
        "in_proj_z": of_qkvz(2 * k + v, v),
        "in_proj_b": rows(ba, 2 * c.num_v_heads, 2 * per, 0, per),
        "in_proj_a": rows(ba, 2 * c.num_v_heads, 2 * per, per, per),
    }


def mixer(weights: ModelWeights, config: ModelConfig, prefix: str) -> GatedDeltaNet:
    return gated_deltanet(weights, config, prefix, fused_projections(config, prefix))


QWEN3_NEXT = Family(
    name="qwen3_next",
    hf_architectures=("Qwen3NextForCausalLM",),
    config=_config,
    tensors=TENSORS,
    mlp=shared_expert_mlp,
    norm_offset=1.0,
    mixer=mixer,
    state_spec=state_spec,
)
