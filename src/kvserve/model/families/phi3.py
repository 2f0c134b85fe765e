"""Phi-3 and Phi-4-mini: q, k and v fused in one qkv_proj and gate and up in one gate_up_proj (served as
the products their rows make), partial rotary (`partial_rotary_factor`), and LongRoPE scaling with short
and long per-pair factors and its attention factor (rope.py says when the long factors apply)."""

from collections.abc import Mapping
from typing import Any

from kvserve.model.families.base import Family, GgufMetadata, LayerTensors, gguf_common_config
from kvserve.model.spec import ModelConfig, decoder_config, layer_count, sliding_window, windows

TENSORS = LayerTensors(qkv=("self_attn.qkv_proj",), gate_up=("mlp.gate_up_proj",))
GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _config(raw: Mapping[str, Any]) -> ModelConfig:
    layers = layer_count(raw)
    raw = dict(raw)
    parameters = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    # Older configs name LongRoPE "su" (and transformers reads Phi-3's "yarn" as LongRoPE too).
    for d in (parameters, scaling):
        if d.get("rope_type", d.get("type")) in ("su", "yarn"):
            d["rope_type"] = "longrope"
            d.pop("type", None)
    target = scaling if scaling else parameters
    if target.get("rope_type") == "longrope":
        target.setdefault("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
        if target["original_max_position_embeddings"] is None:
            raise ValueError("longrope scaling needs original_max_position_embeddings")
    raw["rope_parameters"], raw["rope_scaling"] = parameters, scaling
    factor = raw.get("partial_rotary_factor") or parameters.get("partial_rotary_factor") or 1.0
    sliding = sliding_window(raw, default_on=True)
    config = decoder_config(
        raw,
        "phi3",
        attention_bias=False,
        o_proj_bias=False,
        mlp_bias=False,
        partial_rotary_factor=float(factor),
        sliding_window=sliding,
        windows=windows(raw, layers, sliding),
    )
    scaling = config.rope_scaling_dict
    for key in ("short_factor", "long_factor") if scaling.get("rope_type") == "longrope" else ():
        if len(scaling.get(key) or ()) != config.rotary_dim // 2:
            raise ValueError(f"longrope factors must number {config.rotary_dim // 2} (rotary dim / 2): {key}")
    return config


def _gguf_config(meta: GgufMetadata) -> dict[str, Any]:
    config = gguf_common_config(meta, "Phi3ForCausalLM", "phi3")
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    rotary = int(meta.get("{arch}.rope.dimension_count", head_dim))
    config["partial_rotary_factor"] = rotary / head_dim
    original = meta.get("{arch}.rope.scaling.original_context_length")
    if original is not None:
        config["original_max_position_embeddings"] = int(original)
    window = meta.get("{arch}.attention.sliding_window")
    config["sliding_window"] = int(window) if window else None
    long, short = meta.tensor("rope_factors_long.weight"), meta.tensor("rope_factors_short.weight")
    if (long is None) != (short is None):
        raise ValueError("the GGUF has one of rope_factors_long and rope_factors_short, not both")
    if long is not None and short is not None:
        if original is None:
            raise ValueError("the GGUF's rope factors need {arch}.rope.scaling.original_context_length")
        config["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": [float(v) for v in long],
            "short_factor": [float(v) for v in short],
            "original_max_position_embeddings": int(original),
        }
        attn_factor = meta.get("{arch}.rope.scaling.attn_factor")
        if attn_factor is not None:
            config["rope_scaling"]["attention_factor"] = float(attn_factor)
    return config


PHI3 = Family(
    name="phi3",
    hf_architectures=("Phi3ForCausalLM",),
    config=_config,
    tensors=TENSORS,
    gguf_architectures=("phi3",),
    gguf_config=_gguf_config,
    gguf_layer=GGUF_LAYER,
)
