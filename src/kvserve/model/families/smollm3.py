"""SmolLM3: Llama whose every n-th layer takes no rope (NoPE): `no_rope_layers` (1 where a layer
rotates) or, without it, every `no_rope_layer_interval`-th layer."""

from collections.abc import Mapping
from typing import Any

from kvserve.model.families.base import Family, GgufMetadata, gguf_common_config
from kvserve.model.spec import (
    ROPE_GLOBAL,
    ROPE_NONE,
    ModelConfig,
    decoder_config,
    layer_count,
    sliding_window,
    windows,
)

# llama.cpp has no key for the interval: it fixes it at 4, as SmolLM3's checkpoints have it.
GGUF_NO_ROPE_INTERVAL = 4


def _layer_ropes(raw: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = int(raw.get("no_rope_layer_interval", 4))
        if interval < 1:
            raise ValueError(f"no_rope_layer_interval must be at least 1, not {interval}")
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers or any(f not in (0, 1) for f in flags):
        raise ValueError(f"no_rope_layers must hold 0 or 1 for each of {layers} layers")
    return tuple(ROPE_GLOBAL if f else ROPE_NONE for f in flags)


def _config(raw: Mapping[str, Any]) -> ModelConfig:
    layers = layer_count(raw)
    sliding = sliding_window(raw, default_on=False)
    return decoder_config(
        raw,
        "smollm3",
        sliding_window=sliding,
        windows=windows(raw, layers, sliding),
        layer_ropes=_layer_ropes(raw, layers),
    )


def _gguf_config(meta: GgufMetadata) -> dict[str, Any]:
    config = gguf_common_config(meta, "SmolLM3ForCausalLM", "smollm3")
    config["no_rope_layer_interval"] = GGUF_NO_ROPE_INTERVAL
    return config


SMOLLM3 = Family(
    name="smollm3",
    hf_architectures=("SmolLM3ForCausalLM",),
    config=_config,
    gguf_architectures=("smollm3",),
    gguf_config=_gguf_config,
    gguf_rope_freqs=True,
    gguf_permuted_qk=True,
    # A byte-level BPE tokenizer, read by transformers the same way under any architecture.
    gguf_tokenizer_as="llama",
)
