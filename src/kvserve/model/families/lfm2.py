"""LFM2 (Liquid AI): gated short convolutions beside attention layers, each layer's MLP a SwiGLU.

`layer_types` names each layer "conv" or "full_attention" (else `full_attn_idxs` lists the attention
layers). A conv layer is kvserve.model.short_conv.ShortConv (a recurrent mixer whose state is its last
`conv_L_cache` - 1 inputs); an attention layer has RMSNorms over q and k heads (`q_layernorm`,
`k_layernorm`) and an `out_proj`. Norms are `operator_norm` before the mixer and `ffn_norm` before the
MLP (w1, w3, w2), and the final norm is `embedding_norm`. The MLP's width is adjusted as transformers
does (`block_auto_adjust_ff_dim`: two thirds, times `block_ffn_dim_multiplier`, rounded up to
`block_multiple_of`).

In a GGUF (llama.cpp's "lfm2"): `lfm2.attention.head_count_kv` is an array with 0 for each conv layer,
`lfm2.shortconv.l_cache` the convolution's width, `lfm2.feed_forward_length` the width already adjusted,
`blk.N.shortconv.{in_proj,conv,out_proj}` the conv layer's tensors (conv as [hidden, L]) and
`token_embd_norm` the final norm.
"""

from collections.abc import Mapping
from typing import Any

import torch

from kvserve.errors import ModelLoadError
from kvserve.model.families.base import GGUF_GLOBAL, Family, GgufMetadata, LayerTensors, gguf_common_config
from kvserve.model.recurrent import RecurrentMixer, StateSpec
from kvserve.model.short_conv import ShortConv
from kvserve.model.spec import (
    MAX_CONV_KERNEL,
    MIXER_ATTENTION,
    MIXER_SHORT_CONV,
    ModelConfig,
    decoder_config,
    integer,
    layer_count,
    rope_theta,
)
from kvserve.model.weights import ModelWeights, Rows

TENSORS = LayerTensors(
    attn_norm="operator_norm",
    o="self_attn.out_proj",
    mlp_norm="ffn_norm",
    gate_up=("feed_forward.w1", "feed_forward.w3"),
    down="feed_forward.w2",
    q_norm="self_attn.q_layernorm",
    k_norm="self_attn.k_layernorm",
)
GGUF_LAYER = {
    "attn_norm.weight": "operator_norm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q_norm.weight": "self_attn.q_layernorm.weight",
    "attn_k_norm.weight": "self_attn.k_layernorm.weight",
    "attn_output.weight": "self_attn.out_proj.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight",
    "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
    "shortconv.in_proj.weight": "conv.in_proj.weight",
    "shortconv.in_proj.bias": "conv.in_proj.bias",
    "shortconv.conv.weight": "conv.conv.weight",
    "shortconv.conv.bias": "conv.conv.bias",
    "shortconv.out_proj.weight": "conv.out_proj.weight",
    "shortconv.out_proj.bias": "conv.out_proj.bias",
}
GGUF_FINAL = {**GGUF_GLOBAL, "token_embd_norm.weight": "model.embedding_norm.weight"}
_THETA = 1_000_000.0


def _mixers(raw: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    types = raw.get("layer_types")
    if types is None:
        attending = raw.get("full_attn_idxs")
        attending = list(range(layers)) if attending is None else attending
        if not isinstance(attending, list) or any(not isinstance(i, int) for i in attending):
            raise ValueError("full_attn_idxs must list layer indices")
        types = ["full_attention" if i in attending else "conv" for i in range(layers)]
    if (
        not isinstance(types, list)
        or len(types) != layers
        or any(t not in ("conv", "full_attention") for t in types)
    ):
        raise ValueError(f"layer_types must name conv or full_attention for each of {layers} layers")
    return tuple(MIXER_SHORT_CONV if t == "conv" else MIXER_ATTENTION for t in types)


def _intermediate(raw: Mapping[str, Any]) -> int:
    """The MLP's width, adjusted as transformers' Lfm2MLP does."""
    size = integer(raw.get("block_ff_dim", raw["intermediate_size"]), "intermediate_size")
    if not raw.get("block_auto_adjust_ff_dim", True):
        return size
    size = int(2 * size / 3)
    multiplier = raw.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        multiple = integer(raw.get("block_multiple_of", 256), "block_multiple_of")
        if multiple < 1:
            raise ValueError(f"block_multiple_of must be positive, not {multiple}")
        size = int(float(multiplier) * size)
        size = multiple * ((size + multiple - 1) // multiple)
    return size


def _config(raw: Mapping[str, Any]) -> ModelConfig:
    layers = layer_count(raw)
    kernel = integer(raw.get("conv_L_cache", 3), "conv_L_cache")
    if not 2 <= kernel <= MAX_CONV_KERNEL:
        raise ValueError(f"conv_L_cache must be 2 to {MAX_CONV_KERNEL}, not {kernel}")
    return decoder_config(
        raw,
        "lfm2",
        intermediate_size=_intermediate(raw),
        rms_norm_eps=float(raw.get("norm_eps", 1e-5)),
        rope_theta=rope_theta(raw, _THETA),
        tie_word_embeddings=bool(raw.get("tie_embedding", raw.get("tie_word_embeddings", True))),
        mixers=_mixers(raw, layers),
        conv_kernel=kernel,
        conv_bias=bool(raw.get("conv_bias", False)),
    )


def _gguf_config(meta: GgufMetadata) -> dict[str, Any]:
    kv = meta.get("{arch}.attention.head_count_kv")
    config = gguf_common_config(meta, "Lfm2ForCausalLM", "lfm2", per_layer_kv=True)
    layers = config["num_hidden_layers"]
    if not isinstance(kv, list) or len(kv) != layers:
        raise ValueError(f"{meta.arch}.attention.head_count_kv must give each of the {layers} layers a count")
    config["layer_types"] = ["full_attention" if integer(n, "head_count_kv") else "conv" for n in kv]
    config["conv_L_cache"] = meta.require("{arch}.shortconv.l_cache")
    config["norm_eps"] = config["rms_norm_eps"]
    config["rope_theta"] = float(meta.get("{arch}.rope.freq_base", _THETA))
    # The file's feed_forward_length is the width the layers hold, adjusted already.
    config["block_auto_adjust_ff_dim"] = False
    config["conv_bias"] = meta.has_tensor("blk.0.shortconv.in_proj.bias")
    return config


def _mixer(weights: ModelWeights, config: ModelConfig, prefix: str) -> RecurrentMixer:
    """The conv layer at `prefix`: its convolution must be `conv_kernel` wide, the width its state is
    sized by; a checkpoint's [hidden, 1, K] and a GGUF's [hidden, K] are both read."""
    hidden, k = config.hidden_size, config.conv_kernel
    p = prefix + "conv."

    def bias(name: str, size: int) -> Any:
        return weights.tensor(p + name + ".bias", (size,)) if config.conv_bias else None

    name = p + "conv.weight"
    if name not in weights.tensors:
        raise ModelLoadError(name, "tensor missing from the weight files")
    shape = tuple(weights.tensors[name].shape)
    if shape not in ((hidden, 1, k), (hidden, k)):
        raise ModelLoadError(
            name, f"shape {shape} does not match the config's {(hidden, 1, k)} (hidden, 1, conv_L_cache)"
        )
    weight = weights.tensor(name, shape).reshape(hidden, k)
    in_proj = weights.linear([Rows(p + "in_proj.weight", 3 * hidden)], hidden, bias("in_proj", 3 * hidden))
    out_proj = weights.linear([Rows(p + "out_proj.weight", hidden)], hidden, bias("out_proj", hidden))
    return ShortConv(in_proj, out_proj, weight, bias("conv", hidden), hidden)


def _state_spec(config: ModelConfig, layer: int, dtype: torch.dtype) -> StateSpec:
    """A conv layer's state: its last conv_kernel - 1 inputs per channel."""
    return StateSpec(((config.hidden_size, config.conv_kernel - 1),), dtype)


LFM2 = Family(
    name="lfm2",
    hf_architectures=("Lfm2ForCausalLM",),
    config=_config,
    tensors=TENSORS,
    gguf_architectures=("lfm2",),
    gguf_config=_gguf_config,
    gguf_layer=GGUF_LAYER,
    gguf_global=GGUF_FINAL,
    final_norm="model.embedding_norm.weight",
    mixer=_mixer,
    state_spec=_state_spec,
)
