"""Gemma 3 (text): sliding-window layers interleaved with global ones (`layer_types`, else every
`sliding_window_pattern`-th layer global), the sliding layers' rope on its own local base and the global
layers' with the model's scaling, the softmax scale from `query_pre_attn_scalar`, GeGLU (tanh gelu), the
embedding scaled by sqrt(hidden), norms before and after both attention and MLP, RMSNorms over q and k
heads, and every norm multiplying by (1 + w)."""

from collections.abc import Mapping
from typing import Any

from kvserve.model.families.base import Family, GgufMetadata, LayerTensors, gguf_common_config
from kvserve.model.spec import (
    ROPE_GLOBAL,
    ROPE_LOCAL,
    ModelConfig,
    activation,
    decoder_config,
    integer,
    layer_count,
    layer_types,
    rope_scaling,
    window_size,
    windows,
)

TENSORS = LayerTensors(
    mlp_norm="pre_feedforward_layernorm",
    q_norm="self_attn.q_norm",
    k_norm="self_attn.k_norm",
    post_attn_norm="post_attention_layernorm",
    post_mlp_norm="post_feedforward_layernorm",
)
GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# transformers' defaults for what a Gemma 3 config.json may leave out.
_GLOBAL_THETA = 1_000_000.0
_LOCAL_THETA = 10_000.0
_PATTERN = 6


def _types(raw: Mapping[str, Any], layers: int) -> list[str]:
    types = layer_types(raw, layers)
    if types is not None:
        return types
    pattern = int(raw.get("sliding_window_pattern", _PATTERN))
    if pattern < 1:
        raise ValueError(f"sliding_window_pattern must be at least 1, not {pattern}")
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def _ropes(raw: Mapping[str, Any]) -> tuple[float, tuple[Any, ...], float]:
    """The global base and scaling, and the local base."""
    parameters = raw.get("rope_parameters") or {}
    if "full_attention" in parameters or "sliding_attention" in parameters:
        full = parameters.get("full_attention") or {}
        local = parameters.get("sliding_attention") or {}
        _, scaling = rope_scaling({}, full)
        local_kind, _ = rope_scaling({}, local)
        if local_kind != "default":
            raise ValueError(f"rope scaling {local_kind!r} on the sliding layers is not supported")
        return (
            float(full.get("rope_theta", _GLOBAL_THETA)),
            scaling,
            float(local.get("rope_theta", raw.get("rope_local_base_freq", _LOCAL_THETA))),
        )
    _, scaling = rope_scaling(raw)
    theta = float(raw.get("rope_theta", parameters.get("rope_theta", _GLOBAL_THETA)))
    return theta, scaling, float(raw.get("rope_local_base_freq", _LOCAL_THETA))


def _config(raw: Mapping[str, Any]) -> ModelConfig:
    layers = layer_count(raw)
    types = _types(raw, layers)
    theta, scaling, local_theta = _ropes(raw)
    sliding = window_size(raw.get("sliding_window"))
    return decoder_config(
        raw,
        "gemma3",
        head_dim=integer(raw.get("head_dim", 256), "head_dim"),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=integer(
            raw.get("max_position_embeddings", 131072), "max_position_embeddings"
        ),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        rope_theta=theta,
        rope_scaling=scaling,
        local_rope_theta=local_theta,
        layer_ropes=tuple(ROPE_LOCAL if t == "sliding_attention" else ROPE_GLOBAL for t in types),
        sliding_window=sliding,
        windows=windows({"layer_types": types}, layers, sliding),
        query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
        hidden_act=activation(raw, "hidden_activation", "gelu_pytorch_tanh"),
        scale_embeddings=True,
    )


def _gguf_config(meta: GgufMetadata) -> dict[str, Any]:
    config = gguf_common_config(meta, "Gemma3ForCausalLM", "gemma3_text")
    config["rms_norm_eps"] = float(meta.get("{arch}.attention.layer_norm_rms_epsilon", 1e-6))
    config["rope_theta"] = float(meta.get("{arch}.rope.freq_base", _GLOBAL_THETA))
    config["rope_local_base_freq"] = float(meta.get("{arch}.rope.freq_base_swa", _LOCAL_THETA))
    config["sliding_window"] = int(meta.require("{arch}.attention.sliding_window"))
    config["hidden_activation"] = "gelu_pytorch_tanh"
    head_dim = int(config.get("head_dim", 256))
    config["head_dim"] = head_dim
    # llama.cpp keeps no query_pre_attn_scalar: it takes head_dim, except for the 27B model (62 layers),
    # whose scalar is hidden / heads.
    if config["num_hidden_layers"] == 62:
        config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"]
    else:
        config["query_pre_attn_scalar"] = head_dim
    pattern = meta.get("{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != config["num_hidden_layers"]:
            raise ValueError("the GGUF's sliding_window_pattern does not name every layer")
        config["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        config["sliding_window_pattern"] = int(pattern) if pattern is not None else _PATTERN
    return config


GEMMA3 = Family(
    name="gemma3",
    hf_architectures=("Gemma3ForCausalLM",),
    config=_config,
    tensors=TENSORS,
    norm_offset=1.0,
    gguf_architectures=("gemma3",),
    gguf_config=_gguf_config,
    gguf_layer=GGUF_LAYER,
)
