"""Llama, and the families that are Llama with other defaults: Mistral, SmolLM and SmolLM2."""

from collections.abc import Mapping
from typing import Any

from kvserve.model.families.base import Family, GgufMetadata, gguf_common_config
from kvserve.model.spec import ModelConfig, decoder_config, layer_count, sliding_window, windows


def _config(name: str) -> Any:
    def config(raw: Mapping[str, Any]) -> ModelConfig:
        sliding = sliding_window(raw, default_on=True)
        return decoder_config(
            raw, name, sliding_window=sliding, windows=windows(raw, layer_count(raw), sliding)
        )

    return config


def _gguf_config(meta: GgufMetadata) -> dict[str, Any]:
    return gguf_common_config(meta, "LlamaForCausalLM", "llama")


LLAMA = Family(
    name="llama",
    hf_architectures=("LlamaForCausalLM",),
    config=_config("llama"),
    gguf_architectures=("llama",),
    gguf_config=_gguf_config,
    gguf_rope_freqs=True,
    gguf_permuted_qk=True,
)
# llama.cpp writes Mistral's dense models as `llama`.
MISTRAL = Family(name="mistral", hf_architectures=("MistralForCausalLM",), config=_config("mistral"))
