"""Qwen3.5 (dense, and MoE with a shared expert), the text model: Gated DeltaNet layers
(kvserve.model.gated_deltanet) and gated full-attention layers (kvserve.model.gated_attention), by
`layer_types` or every `full_attention_interval`-th layer attending (three DeltaNet layers before each
attention layer in the released models).

- Every RMSNorm but the DeltaNet's gated one multiplies by (1 + w) (`norm_offset` 1; a GGUF stores 1 + w,
  and the gated norm's w as it is). The attention's q and k norms are of that kind too.
- The attention layers are Qwen3's (q/k norms before rope) with an output gate from q_proj and partial
  rope: `partial_rotary_factor` (0.25 by default) of each head rotates. Qwen3.5's multimodal rope gives
  every section the same position for text, so it is the plain rope on those dimensions.
- The MoE variant's every layer is a sparse MoE block (its routed experts' weights always renormalized)
  plus a shared expert scaled by sigmoid(x . shared_expert_gate).

A GGUF (llama.cpp's `qwen35` and `qwen35moe`) stores the DeltaNet's value heads tiled rather than grouped
by key head (`GatedDeltaNetConfig.v_heads_tiled`), A as -exp(A_log) and the convolution as [C, K]; the
layer reads each as it is.
"""

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from kvserve.errors import ModelLoadError
from kvserve.model.families.base import (
    GGUF_GLOBAL,
    Family,
    GgufMetadata,
    LayerTensors,
    gated_mlp,
    gguf_common_config,
)
from kvserve.model.families.qwen3_moe import moe_config, moe_mlp
from kvserve.model.gated_deltanet import DECAY, GatedDeltaNet, deltanet_state_spec, gated_deltanet
from kvserve.model.mlp import GatedMlp, Mlp
from kvserve.model.moe import SparseMoe
from kvserve.model.recurrent import StateSpec
from kvserve.model.shared_expert import SharedExpertMoe
from kvserve.model.spec import (
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_INTERMEDIATE_SIZE,
    MIXER_GATED_DELTANET,
    GatedDeltaNetConfig,
    ModelConfig,
    MoeConfig,
    decoder_config,
    integer,
    layer_count,
)
from kvserve.model.weights import ModelWeights

TENSORS = LayerTensors(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
# The released checkpoints are the multimodal model's: its text model's tensors under
# `model.language_model.` (the vision tower's and the multi-token-prediction head's are not read).
MULTIMODAL = {"model.language_model.": "model."}
LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
# The most taps of the DeltaNet's convolution a config may claim (the released models: 4).
MAX_CONV_KERNEL = 64
# A GGUF config's key (not transformers'): the value heads are in llama.cpp's tiled order.
GGUF_TILED = "kvserve_gguf_v_heads_tiled"

GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_a": DECAY,
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm.weight": "linear_attn.norm.weight",
}
SHARED_EXPERT = LayerTensors(
    gate_up=("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"), down="mlp.shared_expert.down_proj"
)
GGUF_MOE_LAYER = {
    **{k: v for k, v in GGUF_LAYER.items() if not k.startswith("ffn_")},
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{expert}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{expert}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{expert}.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}


def _text(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's config: `text_config` where the file nests it (the multimodal checkpoints')."""
    text = raw.get("text_config")
    return {**text, "architectures": raw.get("architectures")} if isinstance(text, Mapping) else raw


def layer_kinds(raw: Mapping[str, Any], layers: int) -> tuple[bool, ...]:
    """For each layer whether it is a Gated DeltaNet layer: `layer_types` where given, else every
    `full_attention_interval`-th layer (default 4) attends and the others are DeltaNet layers."""
    types = raw.get("layer_types")
    if types is None:
        interval = integer(raw.get("full_attention_interval", 4), "full_attention_interval")
        if interval < 1:
            raise ValueError(f"full_attention_interval must be positive, not {interval}")
        return tuple((i + 1) % interval != 0 for i in range(layers))
    if not isinstance(types, list | tuple) or len(types) != layers:
        raise ValueError(f"layer_types must name a type for each of the {layers} layers")
    if any(t not in (LINEAR_ATTENTION, FULL_ATTENTION) for t in types):
        raise ValueError(f"layer_types must each be {LINEAR_ATTENTION!r} or {FULL_ATTENTION!r}")
    return tuple(t == LINEAR_ATTENTION for t in types)


def _deltanet(raw: Mapping[str, Any], layers: int) -> GatedDeltaNetConfig:
    def count(key: str, default: int, most: int) -> int:
        value = integer(raw.get(key, default), key)
        if not 0 < value <= most:
            raise ValueError(f"{key} must be 1 to {most}, not {value}")
        return value

    config = GatedDeltaNetConfig(
        num_k_heads=count("linear_num_key_heads", 16, MAX_HEADS),
        num_v_heads=count("linear_num_value_heads", 32, MAX_HEADS),
        k_head_dim=count("linear_key_head_dim", 128, MAX_HEAD_DIM),
        v_head_dim=count("linear_value_head_dim", 128, MAX_HEAD_DIM),
        conv_kernel=count("linear_conv_kernel_dim", 4, MAX_CONV_KERNEL),
        layers=layer_kinds(raw, layers),
        v_heads_tiled=bool(raw.get(GGUF_TILED, False)),
    )
    if config.num_v_heads % config.num_k_heads:
        raise ValueError(
            f"linear_num_value_heads {config.num_v_heads} is not a multiple of linear_num_key_heads "
            f"{config.num_k_heads}"
        )
    return config


def _rotary_fraction(raw: Mapping[str, Any]) -> float:
    params = raw.get("rope_parameters") or {}
    return float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)))


def hybrid_config(raw: Mapping[str, Any], architecture: str, **fields: Any) -> ModelConfig:
    """A config of Gated DeltaNet and gated attention layers (Qwen3.5's, Qwen3-Next's)."""
    layers = layer_count(raw)
    return decoder_config(
        raw,
        architecture,
        partial_rotary_factor=_rotary_fraction(raw),
        deltanet=(deltanet := _deltanet(raw, layers)),
        mixers=tuple(MIXER_GATED_DELTANET if r else "attention" for r in deltanet.layers),
        attention_output_gate=True,
        **fields,
    )


def _config(raw: Mapping[str, Any]) -> ModelConfig:
    return hybrid_config(_text(raw), "qwen3_5")


def _moe_config(raw: Mapping[str, Any]) -> ModelConfig:
    text = _text(raw)
    layers = layer_count(text)
    # Every layer is sparse and the chosen experts' weights always renormalized; there is no dense MLP,
    # so intermediate_size (which the config lacks) is the experts'.
    defaults = {"num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512}
    moe_fields = {**defaults, **text, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
    moe = with_shared_expert(text, moe_config(moe_fields, layers))
    with_size = {**text, "intermediate_size": text.get("intermediate_size", moe.expert_intermediate_size)}
    return hybrid_config(with_size, "qwen3_5_moe", moe=moe)


def with_shared_expert(raw: Mapping[str, Any], moe: MoeConfig) -> MoeConfig:
    """The MoE config with its shared expert's size (`shared_expert_intermediate_size`, 0: none)."""
    shared = integer(raw.get("shared_expert_intermediate_size", 512), "shared_expert_intermediate_size")
    if not 0 <= shared <= MAX_INTERMEDIATE_SIZE:
        raise ValueError(
            f"shared_expert_intermediate_size must be 0 to {MAX_INTERMEDIATE_SIZE}, not {shared}"
        )
    return replace(moe, shared_expert_intermediate_size=shared)


def _gguf_config(meta: GgufMetadata, hf_architecture: str, model_type: str) -> dict[str, Any]:
    config = gguf_common_config(meta, hf_architecture, model_type)

    def count(key: str) -> int:
        return integer(meta.require(key), key.replace("{arch}", meta.arch))

    v_heads = count("{arch}.ssm.time_step_rank")
    inner = count("{arch}.ssm.inner_size")
    if v_heads < 1 or inner % v_heads:
        raise ValueError(f"{meta.arch}.ssm.inner_size {inner} is not whole heads of {v_heads}")
    config["linear_conv_kernel_dim"] = count("{arch}.ssm.conv_kernel")
    config["linear_key_head_dim"] = count("{arch}.ssm.state_size")
    config["linear_num_key_heads"] = count("{arch}.ssm.group_count")
    config["linear_num_value_heads"] = v_heads
    config["linear_value_head_dim"] = inner // v_heads
    config[GGUF_TILED] = True
    recurrent = meta.get("{arch}.attention.recurrent_layers")
    if isinstance(recurrent, list):
        config["layer_types"] = [LINEAR_ATTENTION if r else FULL_ATTENTION for r in recurrent]
    else:
        config["full_attention_interval"] = meta.get("{arch}.full_attention_interval", 4)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    key = "{arch}.rope.dimension_count"
    rotary = integer(meta.get(key, head_dim // 4), key.replace("{arch}", meta.arch))
    fraction = rotary / head_dim
    config["rope_parameters"] = {"rope_theta": config["rope_theta"], "partial_rotary_factor": fraction}
    return config


def _gguf_dense(meta: GgufMetadata) -> dict[str, Any]:
    return _gguf_config(meta, "Qwen3_5ForCausalLM", "qwen3_5_text")


def _gguf_moe(meta: GgufMetadata) -> dict[str, Any]:
    config = _gguf_config(meta, "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text")
    config["num_experts"] = meta.require("{arch}.expert_count")
    config["num_experts_per_tok"] = meta.require("{arch}.expert_used_count")
    config["moe_intermediate_size"] = meta.require("{arch}.expert_feed_forward_length")
    shared = meta.get("{arch}.expert_shared_feed_forward_length")
    if shared is None:
        # No key: the shared expert's size is its tensors' (none: no shared expert).
        up = meta.file.tensors.get("blk.0.ffn_up_shexp.weight")
        shared = up.dims[1] if up is not None and len(up.dims) == 2 else 0
    config["shared_expert_intermediate_size"] = shared
    return config


def mixer(weights: ModelWeights, config: ModelConfig, prefix: str) -> GatedDeltaNet:
    """The Gated DeltaNet of the layer at `prefix` (`model.layers.{i}.`), which
    `GatedDeltaNetConfig.layers` says is one."""
    return gated_deltanet(weights, config, prefix)


def state_spec(config: ModelConfig, layer: int, dtype: torch.dtype) -> StateSpec:
    """A DeltaNet layer's state per sequence as the config makes it (the layer's own `spec`): float32
    whatever the compute dtype, as the recurrence runs."""
    c = config.deltanet
    if c is None or not c.layers[layer]:
        raise ValueError(f"layer {layer} of the {config.architecture} config is not a Gated DeltaNet layer")
    return deltanet_state_spec(c)


def shared_expert_mlp(weights: ModelWeights, config: ModelConfig, names: LayerTensors, prefix: str) -> Mlp:
    """The layer's routed experts (Qwen3-MoE's block) and its shared expert, or a dense layer's MLP
    (Qwen3-Next's `mlp_only_layers`). `prefix` is `model.layers.{i}.`."""
    moe = config.moe
    assert moe is not None
    routed = moe_mlp(weights, config, names, prefix)
    if not isinstance(routed, SparseMoe) or not moe.shared_expert_intermediate_size:
        return routed
    shared_config = replace(config, intermediate_size=moe.shared_expert_intermediate_size, mlp_bias=False)
    shared = gated_mlp(weights, shared_config, SHARED_EXPERT, prefix)
    assert isinstance(shared, GatedMlp)
    gate_name = prefix + "mlp.shared_expert_gate.weight"
    if gate_name not in weights.tensors:
        raise ModelLoadError(gate_name, "tensor missing from the weight files")
    hidden = config.hidden_size
    # [1, hidden] in a checkpoint (a Linear to one output); a GGUF may store it as a vector.
    stored = tuple(weights.tensors[gate_name].shape)
    gate = weights.tensor(gate_name, stored if stored == (hidden,) else (1, hidden)).reshape(hidden)
    return SharedExpertMoe(routed, shared, gate)


QWEN3_5 = Family(
    name="qwen3_5",
    hf_architectures=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    config=_config,
    tensors=TENSORS,
    norm_offset=1.0,
    gguf_architectures=("qwen35",),
    gguf_config=_gguf_dense,
    gguf_layer=GGUF_LAYER,
    gguf_global=GGUF_GLOBAL,
    gguf_tokenizer_as="qwen3",
    hf_prefixes=MULTIMODAL,
    mixer=mixer,
    state_spec=state_spec,
)

QWEN3_5_MOE = Family(
    name="qwen3_5_moe",
    hf_architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    config=_moe_config,
    tensors=TENSORS,
    mlp=shared_expert_mlp,
    norm_offset=1.0,
    gguf_architectures=("qwen35moe",),
    gguf_config=_gguf_moe,
    gguf_layer=GGUF_MOE_LAYER,
    gguf_global=GGUF_GLOBAL,
    gguf_tokenizer_as="qwen3",
    hf_prefixes=MULTIMODAL,
    mixer=mixer,
    state_spec=state_spec,
)
