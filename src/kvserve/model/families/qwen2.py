"""Qwen2: Llama with biases on the q, k and v projections (not on o), and sliding windows only on the
layers from `max_window_layers` on, when `use_sliding_window` says so."""

from collections.abc import Mapping
from typing import Any

from kvserve.model.families.base import Family, GgufMetadata, gguf_common_config
from kvserve.model.spec import ModelConfig, decoder_config, layer_count, sliding_window, windows


def _config(raw: Mapping[str, Any]) -> ModelConfig:
    layers = layer_count(raw)
    sliding = sliding_window(raw, default_on=False)
    return decoder_config(
        raw,
        "qwen2",
        attention_bias=True,
        o_proj_bias=False,
        sliding_window=sliding,
        windows=windows(raw, layers, sliding, first_sliding=int(raw.get("max_window_layers", layers))),
    )


def _gguf_config(meta: GgufMetadata) -> dict[str, Any]:
    return gguf_common_config(meta, "Qwen2ForCausalLM", "qwen2")


QWEN2 = Family(
    name="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    config=_config,
    gguf_architectures=("qwen2",),
    gguf_config=_gguf_config,
    gguf_rope_freqs=True,
)
