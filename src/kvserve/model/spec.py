"""ModelConfig: the hyperparameters of a Llama-family decoder, read from a Hugging Face config.json."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Hugging Face architecture name -> our family name. Mistral and SmolLM are Llama with other defaults;
# Qwen2 adds a bias to the q/k/v projections.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    o_proj_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Each layer's attention window in tokens (a token sees itself and the window - 1 before it), None for
    # a global layer; empty means every layer is global. Filled from `layer_types` or `sliding_window`.
    windows: tuple[int | None, ...] = ()

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


def _eos_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    raise ValueError(f"eos_token_id must be an int or a list of ints, got {value!r}")


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _refuse_unimplemented(raw: Mapping[str, Any], rope_type: str) -> None:
    """A field that would change the math and that the forward pass does not implement is an error:
    serving such a model anyway would give fluent but wrong text."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope scaling {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(name):
            raise ValueError(f"{name} is not supported")


def _windows(
    raw: Mapping[str, Any], family: str, num_layers: int, sliding: int | None
) -> tuple[int | None, ...]:
    """Per-layer windows: transformers' `layer_types` where given, else Qwen2's rule (layers from
    `max_window_layers` on slide), else every layer slides when the config has a window."""
    if sliding is None:
        return ()
    types = raw.get("layer_types")
    if types is None and family == "qwen2":
        first = int(raw.get("max_window_layers", num_layers))
        types = ["full_attention" if i < first else "sliding_attention" for i in range(num_layers)]
    if types is None:
        return (sliding,) * num_layers
    if len(types) != num_layers or any(t not in ("full_attention", "sliding_attention") for t in types):
        raise ValueError(
            f"layer_types must name full_attention or sliding_attention for each of {num_layers} layers"
        )
    return tuple(sliding if t == "sliding_attention" else None for t in types)


def config_from_hf(raw: Mapping[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a parsed config.json; raises ValueError naming what is missing or wrong."""
    architectures = raw.get("architectures") or []
    family = next((SUPPORTED_ARCHITECTURES[a] for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if family is None:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise ValueError(f"unsupported architecture {architectures or 'none given'}; supported: {supported}")
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        rope_parameters = raw.get("rope_parameters") or {}
        rope_scaling = raw.get("rope_scaling") or {
            k: v for k, v in rope_parameters.items() if k not in ("rope_theta",)
        }
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        _refuse_unimplemented(raw, rope_type)
        scaling = () if rope_type == "default" else tuple(sorted(rope_scaling.items()))
        rope_theta = raw.get("rope_theta", rope_parameters.get("rope_theta", 10000.0))
        sliding = raw.get("sliding_window") if raw.get("use_sliding_window", family != "qwen2") else None
        num_layers = int(raw["num_hidden_layers"])
        return ModelConfig(
            architecture=family,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
            # Llama's attention_bias covers o_proj too; Qwen2 has biases on q/k/v only.
            o_proj_bias=family != "qwen2" and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            rope_scaling=scaling,
            sliding_window=int(sliding) if sliding else None,
            eos_token_ids=_eos_ids(raw.get("eos_token_id")),
            windows=_windows(raw, family, num_layers, int(sliding) if sliding else None),
        )
    except KeyError as e:
        raise ValueError(f"config.json lacks the field {e.args[0]!r}") from None
