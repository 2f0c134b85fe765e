"""Qwen3 (dense): Llama with an RMSNorm over each q and k head before rope, an explicit head_dim, and
no biases unless `attention_bias` says so."""

from collections.abc import Mapping
from typing import Any

from kvserve.model.families.base import (
    LLAMA_GGUF_LAYER,
    Family,
    GgufMetadata,
    LayerTensors,
    gguf_common_config,
)
from kvserve.model.spec import ModelConfig, decoder_config, layer_count, sliding_window, windows

TENSORS = LayerTensors(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm")
GGUF_LAYER = {
    **LLAMA_GGUF_LAYER,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}


def _config(raw: Mapping[str, Any]) -> ModelConfig:
    layers = layer_count(raw)
    sliding = sliding_window(raw, default_on=False)
    return decoder_config(
        raw,
        "qwen3",
        sliding_window=sliding,
        windows=windows(raw, layers, sliding, first_sliding=int(raw.get("max_window_layers", layers))),
    )


def _gguf_config(meta: GgufMetadata) -> dict[str, Any]:
    return gguf_common_config(meta, "Qwen3ForCausalLM", "qwen3")


QWEN3 = Family(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    config=_config,
    tensors=TENSORS,
    gguf_architectures=("qwen3",),
    gguf_config=_gguf_config,
    gguf_rope_freqs=True,
    gguf_layer=GGUF_LAYER,
)
