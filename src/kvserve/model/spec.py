"""ModelConfig: the hyperparameters of a decoder, whatever its family, and the parsing every family
shares. Each family's module (model/families/) maps its config.json and GGUF metadata onto it."""

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The positional encodings a layer may take (`ModelConfig.layer_ropes`): the model's rope, the rope of
# the sliding layers (Gemma 3's local base), or none (NoPE).
ROPE_GLOBAL = "global"
ROPE_LOCAL = "local"
ROPE_NONE = "none"

# What a layer mixes its tokens with (`ModelConfig.mixers`): attention over the KV cache, or a recurrent
# mixer that keeps a fixed-size state per sequence (kvserve.model.recurrent), such as LFM2's gated short
# convolution.
MIXER_ATTENTION = "attention"
MIXER_SHORT_CONV = "short_conv"
MIXER_GATED_DELTANET = "gated_deltanet"
MIXERS = (MIXER_ATTENTION, MIXER_SHORT_CONV, MIXER_GATED_DELTANET)
# The longest short convolution a config may claim (LFM2's is 3 wide).
MAX_CONV_KERNEL = 64

# Activations of the gated MLP, by their Hugging Face names: silu (SwiGLU) and tanh-approximated gelu
# (GeGLU).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

# The longest context a config may claim: rope positions are float32, exact up to 2**24 (no released
# model claims more than 10M tokens). A claim past it is refused at load, before any table is sized by it.
MAX_CONTEXT_LENGTH = 1 << 24
# Bounds of the counts a config may claim, far above any released model's (Llama 3.1 405B: 126 layers,
# 128 heads, hidden 16384; Gemma 3: a vocabulary of 262,208): a count past them is refused at load,
# before a per-layer table, a rope table or a tokenizer is sized by it.
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_HIDDEN_SIZE = 1 << 16
MAX_INTERMEDIATE_SIZE = 1 << 20
MAX_VOCAB_SIZE = 1 << 19
# The range of a rope scaling factor (Llama 3's run from 1 to 32, YaRN's to 40): far outside it, the
# rotation angles overflow float32 or stand still.
ROPE_FACTOR_RANGE = (2.0**-16, 2.0**16)


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
    # gpt-oss: the router and every expert product carry a bias, and the experts' SwiGLU is clamped
    # ((alpha, limit): kvserve.model.mlp.ClampedSwiGlu); None: Qwen3-MoE's plain SwiGLU without biases.
    clamped_swiglu: tuple[float, float] | None = None
    # The shared expert beside the routed ones (Qwen3.5-MoE): a SwiGLU MLP of this size whose output is
    # scaled by sigmoid(x . shared_expert_gate) and added to theirs; 0: none.
    shared_expert_intermediate_size: int = 0


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    """Qwen3.5's Gated DeltaNet layers (kvserve.model.gated_deltanet): `layers` says for each layer
    whether it is one (else it is a gated full-attention layer). Queries and keys have `num_k_heads`
    heads of `k_head_dim`, values `num_v_heads` of `v_head_dim` (a multiple of the key heads: each key
    head serves num_v_heads // num_k_heads value heads); a depthwise causal convolution of `conv_kernel`
    taps runs over q, k and v. `v_heads_tiled`: the value heads' order in the weights is llama.cpp's
    (value head p reads key head p % num_k_heads) rather than Hugging Face's (p // (num_v // num_k))."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    layers: tuple[bool, ...]
    v_heads_tiled: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """The channels the convolution runs over: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


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
    # Qwen3.5's linear-attention layers; None: every layer attends.
    deltanet: GatedDeltaNetConfig | None = None
    # The attention layers' q_proj also yields a gate per query dimension (its rows per head: the query's
    # head_dim, then the gate's), and the attention output is multiplied by sigmoid(gate) before o_proj.
    attention_output_gate: bool = False
    # Per-pair divisors of the global rope's frequencies, on top of `rope_scaling`: a GGUF's rope_freqs
    # tensor (llama.cpp's form of Llama 3's scaling), applied as llama.cpp does; empty: none.
    rope_freq_factors: tuple[float, ...] = ()
    # Each layer's mixer (MIXERS); empty means every layer attends. Only attention layers have KV.
    mixers: tuple[str, ...] = ()
    # The short convolution's width in tokens (LFM2's conv_L_cache) and whether its products have biases.
    conv_kernel: int = 0
    conv_bias: bool = False

    def mixer(self, layer: int) -> str:
        return self.mixers[layer] if self.mixers else MIXER_ATTENTION

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that attend (and so hold KV), in order."""
        return tuple(i for i in range(self.num_layers) if self.mixer(i) == MIXER_ATTENTION)

    @property
    def hybrid(self) -> bool:
        """Whether some layer keeps a recurrent state instead of KV."""
        return len(self.attention_layers) < self.num_layers

    # Each attention head has a learned sink: a logit that joins its softmax's denominator and attends
    # to nothing (gpt-oss's `self_attn.sinks`).
    attention_sinks: bool = False

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
        return 2 * len(self.attention_layers) * self.num_kv_heads * self.head_dim * element_size


def integer(value: object, name: str) -> int:
    """A count from a config: an int (a float only where it is whole), never a bool (`true` is an int in
    Python) nor a string."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, not {value!r}")
    return value


def layer_count(raw: Mapping[str, Any]) -> int:
    """`num_hidden_layers`, checked before anything is sized by it (per-layer windows, ropes, experts)."""
    layers = integer(raw["num_hidden_layers"], "num_hidden_layers")
    if not 0 < layers <= MAX_LAYERS:
        raise ValueError(f"num_hidden_layers must be 1 to {MAX_LAYERS}, not {layers}")
    return layers


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
        hidden = integer(raw["hidden_size"], "hidden_size")
        heads = integer(raw["num_attention_heads"], "num_attention_heads")
        if "head_dim" not in fields and not raw.get("head_dim") and heads > 0 and hidden % heads:
            raise ValueError(
                f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}, and no head_dim "
                "is given"
            )
        _, scaling = rope_scaling(raw)
        refuse_unimplemented(raw)
        common: dict[str, Any] = dict(
            architecture=architecture,
            vocab_size=integer(raw["vocab_size"], "vocab_size"),
            hidden_size=hidden,
            intermediate_size=integer(raw["intermediate_size"], "intermediate_size"),
            num_layers=layer_count(raw),
            num_heads=heads,
            num_kv_heads=integer(raw.get("num_key_value_heads") or heads, "num_key_value_heads"),
            head_dim=integer(raw.get("head_dim") or hidden // heads, "head_dim"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta(raw),
            max_position_embeddings=integer(
                raw.get("max_position_embeddings", 2048), "max_position_embeddings"
            ),
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
    _check_math(config)
    return config


def _check_shape(c: ModelConfig) -> None:
    """Sizes a forward pass can run: positive, whole groups of query heads per KV head, and a context
    within MAX_CONTEXT_LENGTH; every count within the bounds above."""
    sizes = {
        "vocab_size": (c.vocab_size, MAX_VOCAB_SIZE),
        "hidden_size": (c.hidden_size, MAX_HIDDEN_SIZE),
        "intermediate_size": (c.intermediate_size, MAX_INTERMEDIATE_SIZE),
        "num_hidden_layers": (c.num_layers, MAX_LAYERS),
        "num_attention_heads": (c.num_heads, MAX_HEADS),
        "num_key_value_heads": (c.num_kv_heads, MAX_HEADS),
        "head_dim": (c.head_dim, MAX_HEAD_DIM),
    }
    for name, (value, most) in sizes.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, not {value}")
        if value > most:
            raise ValueError(f"{name} {value} is more than kvserve serves (at most {most})")
    if not 0 < c.max_position_embeddings <= MAX_CONTEXT_LENGTH:
        raise ValueError(
            f"max_position_embeddings {c.max_position_embeddings} is not a context kvserve serves "
            f"(1 to {MAX_CONTEXT_LENGTH} tokens)"
        )
    if c.num_heads % c.num_kv_heads:
        raise ValueError(
            f"num_attention_heads {c.num_heads} is not a multiple of num_key_value_heads {c.num_kv_heads}"
        )
    if c.mixers and (len(c.mixers) != c.num_layers or any(m not in MIXERS for m in c.mixers)):
        raise ValueError(f"the layers' mixers must name one of {MIXERS} for each of {c.num_layers} layers")
    if MIXER_SHORT_CONV in c.mixers and not 2 <= c.conv_kernel <= MAX_CONV_KERNEL:
        raise ValueError(f"the short convolution's width must be 2 to {MAX_CONV_KERNEL}, not {c.conv_kernel}")
    if c.hybrid and any(c.window(i) is not None for i in range(c.num_layers)):
        raise ValueError("sliding windows beside recurrent layers are not supported")


def sliding_window(raw: Mapping[str, Any], default_on: bool) -> int | None:
    """`sliding_window` where the config uses it (`use_sliding_window`, on by default for some families);
    null turns it off."""
    return window_size(raw.get("sliding_window") if raw.get("use_sliding_window", default_on) else None)


def window_size(value: object) -> int | None:
    """A sliding window in tokens (None: none), 1 to MAX_CONTEXT_LENGTH: the attention backends take
    each window as a positive count, and a window past every context is no window."""
    if value is None:
        return None
    window = integer(value, "sliding_window")
    if not 0 < window <= MAX_CONTEXT_LENGTH:
        raise ValueError(
            f"sliding_window must be 1 to {MAX_CONTEXT_LENGTH} tokens, not {window} (null turns it off)"
        )
    return window


def _check_math(c: ModelConfig) -> None:
    """The values the forward pass computes with: a finite positive eps, rope bases above 1, an even
    rotary dimension, a softmax scale, windows of at least one token, and rope scaling with every field
    its type needs, each in range. Each would otherwise load and then fail (or serve NaN) later."""
    if not (math.isfinite(c.rms_norm_eps) and 0 < c.rms_norm_eps < 1):
        raise ValueError(f"rms_norm_eps must be a finite number between 0 and 1, not {c.rms_norm_eps}")
    for name, base in (("rope_theta", c.rope_theta), ("rope_local_base_freq", c.local_rope_theta)):
        if not (math.isfinite(base) and base > 1):
            raise ValueError(f"{name} must be a finite number above 1, not {base}")
    factor = c.partial_rotary_factor
    if not (math.isfinite(factor) and 0 < factor <= 1) or c.rotary_dim < 2 or c.rotary_dim % 2:
        raise ValueError(
            f"partial_rotary_factor {factor} leaves no even rotary dimension of head_dim {c.head_dim}"
        )
    scalar = c.query_pre_attn_scalar
    if scalar is not None and not (math.isfinite(scalar) and scalar > 0):
        raise ValueError(f"query_pre_attn_scalar must be a finite positive number, not {scalar}")
    for window in c.windows:
        if window is not None:
            window_size(window)
    _check_rope_scaling(c.rope_scaling_dict)


def _check_rope_scaling(scaling: Mapping[str, Any]) -> None:
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return
    low, high = ROPE_FACTOR_RANGE

    def number(key: str, least: float = low, required: bool = True) -> float | None:
        value = scaling.get(key)
        if value is None and not required:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not least <= value <= high:
            what = "missing" if value is None else repr(value)
            bounds = f"{'2**-16' if least == low else f'{least:g}'} to 2**16"
            raise ValueError(f"{kind} rope scaling needs {key} from {bounds}, not {what}")
        return float(value)

    def context(required: bool) -> None:
        value = scaling.get("original_max_position_embeddings")
        if value is None and not required:
            return
        if value is None or not 0 < integer(value, "original_max_position_embeddings") <= MAX_CONTEXT_LENGTH:
            raise ValueError(
                f"{kind} rope scaling needs original_max_position_embeddings from 1 to "
                f"{MAX_CONTEXT_LENGTH}, not {value!r}"
            )

    if kind in ("linear", "llama3", "yarn"):
        number("factor", least=1.0)
    if kind == "llama3":
        low_freq, high_freq = number("low_freq_factor"), number("high_freq_factor")
        if low_freq is not None and high_freq is not None and not low_freq < high_freq:
            raise ValueError(f"llama3 rope scaling needs low_freq_factor {low_freq} below high_freq_factor")
        context(required=True)
    if kind == "yarn":
        for key in ("attention_factor", "beta_fast", "beta_slow"):
            number(key, required=False)
        context(required=False)
    if kind == "longrope":
        number("factor", required=False)
        number("attention_factor", required=False)
        context(required=True)
        for key in ("short_factor", "long_factor"):
            factors = scaling.get(key)
            if not isinstance(factors, tuple | list) or not all(
                not isinstance(f, bool) and isinstance(f, int | float) and low <= f <= high for f in factors
            ):
                raise ValueError(f"longrope rope scaling needs {key}: a list of factors from 2**-16 to 2**16")
