"""ModelConfig: the hyperparameters of a decoder, whatever its family, and the parsing every family
shares. Each family's module (model/families/) maps its config.json and GGUF metadata onto it."""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The positional encodings a layer may take (`ModelConfig.layer_ropes`): the model's rope, the rope of
# the sliding layers (Gemma 3's local base), or none (NoPE).
ROPE_GLOBAL = "global"
ROPE_LOCAL = "local"
ROPE_NONE = "none"

# Activations of the gated MLP, by their Hugging Face names: silu (SwiGLU) and tanh-approximated gelu
# (GeGLU).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

# The longest context a config may claim: rope positions are float32, exact up to 2**24 (no released
# model claims more than 10M tokens). A claim past it is refused at load, before any table is sized by it.
MAX_CONTEXT_LENGTH = 1 << 24


@dataclass(frozen=True)
class MoeConfig:
    """A sparse mixture-of-experts MLP (Qwen3-MoE; kvserve.model.moe): `num_experts` SwiGLU experts of
    `expert_intermediate_size`, `top_k` of them per token, their weights renormalized to sum to 1 when
    `norm_topk_prob`. `sparse_layers` says for each layer whether its MLP is this block (else the dense
    MLP of `intermediate_size`)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]


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
    hidden_act: str = "silu"
    # The attention's softmax scale is this ** -0.5 (Gemma's query_pre_attn_scalar); None: head_dim.
    query_pre_attn_scalar: float | None = None
    # The fraction of each head's dimensions that rope rotates (the first ones); the rest pass through.
    partial_rotary_factor: float = 1.0
    # Each layer's rope (ROPE_GLOBAL, ROPE_LOCAL or ROPE_NONE); empty means every layer's is global.
    layer_ropes: tuple[str, ...] = ()
    # The base of the local rope (default scaling), for layers whose rope is ROPE_LOCAL.
    local_rope_theta: float = 10000.0
    # The embedding rows are multiplied by sqrt(hidden_size), rounded to the compute dtype (Gemma).
    scale_embeddings: bool = False
    # The mixture-of-experts MLP of the sparse layers; None: every layer's MLP is dense.
    moe: MoeConfig | None = None
    # Per-pair divisors of the global rope's frequencies, on top of `rope_scaling`: a GGUF's rope_freqs
    # tensor (llama.cpp's form of Llama 3's scaling), applied as llama.cpp does; empty: none.
    rope_freq_factors: tuple[float, ...] = ()

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    def rope(self, layer: int) -> str:
        return self.layer_ropes[layer] if self.layer_ropes else ROPE_GLOBAL

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        scalar = self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        return float(scalar**-0.5)

    @property
    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


def eos_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    raise ValueError(f"eos_token_id must be an int or a list of ints, got {value!r}")


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# Keys of a rope_parameters dict that are not part of the scaling: the base and the rotated fraction.
_NOT_SCALING = ("rope_theta", "partial_rotary_factor")


def rope_scaling(
    raw: Mapping[str, Any], params: Mapping[str, Any] | None = None
) -> tuple[str, tuple[Any, ...]]:
    """The rope type and the scaling fields (sorted, hashable) of a config: `rope_scaling` where given,
    else `rope_parameters` (or `params`, one layer type's entry) less the base; refuses an unknown type."""
    parameters = params if params is not None else raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") if params is None else None
    scaling = scaling or {k: v for k, v in parameters.items() if k not in _NOT_SCALING}
    kind = str(scaling.get("rope_type", scaling.get("type", "default")))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope scaling {kind!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    items = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items()))
    return kind, () if kind == "default" else items


def rope_theta(raw: Mapping[str, Any], default: float = 10000.0) -> float:
    parameters = raw.get("rope_parameters") or {}
    return float(raw.get("rope_theta", parameters.get("rope_theta", default)))


def activation(raw: Mapping[str, Any], key: str = "hidden_act", default: str = "silu") -> str:
    act = raw.get(key, default)
    if act not in ACTIVATIONS:
        raise ValueError(f"{key} {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return str(act)


def refuse_unimplemented(raw: Mapping[str, Any]) -> None:
    """A field that would change the math and that the forward pass does not implement is an error:
    serving such a model anyway would give fluent but wrong text."""
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(name):
            raise ValueError(f"{name} is not supported")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported (a decoder attends causally)")


def layer_types(raw: Mapping[str, Any], num_layers: int) -> list[str] | None:
    types = raw.get("layer_types")
    if types is None:
        return None
    if len(types) != num_layers or any(t not in ("full_attention", "sliding_attention") for t in types):
        raise ValueError(
            f"layer_types must name full_attention or sliding_attention for each of {num_layers} layers"
        )
    return list(types)


def windows(
    raw: Mapping[str, Any], num_layers: int, sliding: int | None, first_sliding: int | None = None
) -> tuple[int | None, ...]:
    """Per-layer windows: transformers' `layer_types` where given, else layers from `first_sliding` on
    slide (Qwen2's `max_window_layers`), else every layer slides when the config has a window."""
    if sliding is None:
        return ()
    types = layer_types(raw, num_layers)
    if types is None and first_sliding is not None:
        types = ["full_attention" if i < first_sliding else "sliding_attention" for i in range(num_layers)]
    if types is None:
        return (sliding,) * num_layers
    return tuple(sliding if t == "sliding_attention" else None for t in types)


def decoder_config(raw: Mapping[str, Any], architecture: str, **fields: Any) -> ModelConfig:
    """The fields every family reads the same way from config.json, then the family's own `fields`
    (which win). Raises ValueError naming a missing or wrong field."""
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        _, scaling = rope_scaling(raw)
        refuse_unimplemented(raw)
        common: dict[str, Any] = dict(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            o_proj_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            rope_scaling=scaling,
            eos_token_ids=eos_ids(raw.get("eos_token_id")),
            hidden_act=activation(raw),
        )
        config = ModelConfig(**{**common, **fields})
    except KeyError as e:
        raise ValueError(f"config.json lacks the field {e.args[0]!r}") from None
    except ZeroDivisionError:
        raise ValueError("num_attention_heads must be positive") from None
    _check_shape(config)
    return config


def _check_shape(c: ModelConfig) -> None:
    """Sizes a forward pass can run: positive, whole groups of query heads per KV head, and a context
    within MAX_CONTEXT_LENGTH."""
    sizes = {
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
    }
    for name, value in sizes.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, not {value}")
    if not 0 < c.max_position_embeddings <= MAX_CONTEXT_LENGTH:
        raise ValueError(
            f"max_position_embeddings {c.max_position_embeddings} is not a context kvserve serves "
            f"(1 to {MAX_CONTEXT_LENGTH} tokens)"
        )
    if c.num_heads % c.num_kv_heads:
        raise ValueError(
            f"num_attention_heads {c.num_heads} is not a multiple of num_key_value_heads {c.num_kv_heads}"
        )


def sliding_window(raw: Mapping[str, Any], default_on: bool) -> int | None:
    """`sliding_window` where the config uses it (`use_sliding_window`, on by default for some families)."""
    value = raw.get("sliding_window") if raw.get("use_sliding_window", default_on) else None
    return int(value) if value else None
