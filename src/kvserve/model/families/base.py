"""What a model family declares, and the pieces most families share.

A family is one `Family` value in its own module: the Hugging Face architectures and the GGUF
`general.architecture` it answers to, how its ModelConfig comes from config.json and from GGUF metadata,
its tensor names in both formats, and which shared pieces its layers use (the tensors its
`LayerTensors` names: q/k norms, post norms, fused products; the MLP its `mlp` builds). Config fields
that change the math are read by the family or refused there (spec.py holds the shared rules).
"""

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvserve.model.gguf_file import ARRAY, GgufFile
from kvserve.model.mlp import GatedMlp, Mlp
from kvserve.model.recurrent import RecurrentMixer, StateSpec
from kvserve.model.spec import MAX_CONTEXT_LENGTH, ModelConfig, integer
from kvserve.model.weights import ModelWeights, Rows


@dataclass(frozen=True)
class LayerTensors:
    """A layer's tensor names in a Hugging Face checkpoint, after `model.layers.{i}.` and before
    `.weight`. A product given as one name is fused in the checkpoint (Phi-3's qkv_proj, gate_up_proj);
    a norm given as None is not in the layer."""

    attn_norm: str = "input_layernorm"
    qkv: tuple[str, ...] = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    o: str = "self_attn.o_proj"
    mlp_norm: str = "post_attention_layernorm"
    gate_up: tuple[str, ...] = ("mlp.gate_proj", "mlp.up_proj")
    down: str = "mlp.down_proj"
    q_norm: str | None = None
    k_norm: str | None = None
    post_attn_norm: str | None = None
    post_mlp_norm: str | None = None
    # Each head's attention sink logit, a [heads] tensor (gpt-oss), where ModelConfig.attention_sinks.
    sinks: str | None = None


def gated_mlp(weights: ModelWeights, config: ModelConfig, names: LayerTensors, prefix: str) -> Mlp:
    """The dense gated MLP (SwiGLU or GeGLU, by `config.hidden_act`) of the layer at `prefix`."""
    hidden, inter = config.hidden_size, config.intermediate_size

    def bias(name: str, size: int) -> Any:
        return weights.tensor(prefix + name + ".bias", (size,)) if config.mlp_bias else None

    if len(names.gate_up) == 1:
        fused = prefix + names.gate_up[0] + ".weight"
        gate = weights.linear([Rows(fused, 2 * inter, 0, inter)], hidden)
        up = weights.linear([Rows(fused, 2 * inter, inter)], hidden)
    else:
        gate_name, up_name = names.gate_up
        gate = weights.linear([Rows(prefix + gate_name + ".weight", inter)], hidden, bias(gate_name, inter))
        up = weights.linear([Rows(prefix + up_name + ".weight", inter)], hidden, bias(up_name, inter))
    down = weights.linear([Rows(prefix + names.down + ".weight", hidden)], inter, bias(names.down, hidden))
    return GatedMlp(gate, up, down, config.hidden_act)


MlpBuilder = Callable[[ModelWeights, ModelConfig, LayerTensors, str], Mlp]
MixerBuilder = Callable[[ModelWeights, ModelConfig, str], RecurrentMixer]


class GgufMetadata:
    """A GGUF file's metadata and small tensors, read by the families' `gguf_config`."""

    def __init__(self, file: GgufFile) -> None:
        self.file = file
        arch = file.value("general.architecture")
        self.arch = arch if isinstance(arch, str) else ""

    def get(self, key: str, default: Any = None) -> Any:
        """The value of `key`, where `{arch}` stands for the file's architecture."""
        value = self.file.value(key.replace("{arch}", self.arch))
        return default if value is None else value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"the GGUF metadata lacks {key.replace('{arch}', self.arch)}")
        return value

    def count(self, key: str) -> int | None:
        """The length of the array `key` (not read); None where the file has no such array."""
        f = self.file.fields.get(key.replace("{arch}", self.arch))
        return None if f is None or f.type != ARRAY else f.count

    def tensor(self, name: str) -> np.ndarray | None:
        t = self.file.tensors.get(name)
        return None if t is None else self.file.floats(t).reshape(-1)

    def has_tensor(self, name: str) -> bool:
        return name in self.file.tensors


def gguf_common_config(
    meta: GgufMetadata, hf_architecture: str, model_type: str, per_layer_kv: bool = False
) -> dict[str, Any]:
    """config.json fields every family reads the same way from llama.cpp's keys; `per_layer_kv`: the
    KV head count may be one per layer (a hybrid's, 0 where a layer has no attention)."""

    def count(key: str, default: object = None) -> int:
        name = key.replace("{arch}", meta.arch)
        return integer(meta.require(key) if default is None else meta.get(key, default), name)

    n_head = count("{arch}.attention.head_count")
    config: dict[str, Any] = {
        "architectures": [hf_architecture],
        "model_type": model_type,
        "vocab_size": count("{arch}.vocab_size", meta.count("tokenizer.ggml.tokens") or 0),
        "hidden_size": count("{arch}.embedding_length"),
        "intermediate_size": count("{arch}.feed_forward_length"),
        "num_hidden_layers": count("{arch}.block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": _kv_heads(meta, n_head, per_layer_kv),
        "rms_norm_eps": float(meta.get("{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get("{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": _context_length(meta),
        "tie_word_embeddings": not meta.has_tensor("output.weight"),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    # Biases are in the file or not; Llama's attention_bias covers q, k, v and o alike.
    config["attention_bias"] = meta.has_tensor("blk.0.attn_q.bias")
    config["mlp_bias"] = meta.has_tensor("blk.0.ffn_down.bias")
    if n_head <= 0 or config["num_key_value_heads"] <= 0:
        raise ValueError("the GGUF's attention head counts must be positive")
    key_length = meta.get("{arch}.attention.key_length")
    if key_length is not None:
        config["head_dim"] = count("{arch}.attention.key_length")
    scaling = _gguf_rope_scaling(meta)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _kv_heads(meta: GgufMetadata, n_head: int, per_layer: bool) -> int:
    """`{arch}.attention.head_count_kv`: one count, or (`per_layer`, hybrid models) one per layer, 0 for
    a layer without attention, whose positive counts must agree."""
    value = meta.get("{arch}.attention.head_count_kv", n_head)
    name = f"{meta.arch}.attention.head_count_kv"
    if not per_layer or not isinstance(value, list):
        return integer(value, name)
    counts = {integer(v, name) for v in value} - {0}
    if len(counts) != 1:
        raise ValueError(f"{name} must give the attention layers one positive count, not {sorted(counts)}")
    return counts.pop()


# llama.cpp's rope scaling types that the families read here: none, linear and YaRN; LongRoPE's factors
# are tensors (Phi-3 reads them), Llama 3's a rope_freqs tensor (gguf_weights.with_rope_freqs).
_GGUF_ROPE_TYPES = ("none", "linear", "yarn", "longrope")


def _gguf_rope_scaling(meta: GgufMetadata) -> dict[str, Any] | None:
    """The rope_scaling of `{arch}.rope.scaling.*` (range-checked with every config's, in spec.py).

    YaRN's `attn_factor` is llama.cpp's: a multiplier of the magnitude correction 1 + 0.1 ln(factor),
    which transformers' `attention_factor` replaces; so the product is transformers' value."""
    kind = meta.get("{arch}.rope.scaling.type")
    if kind is None or kind in ("none", "longrope"):
        return None
    if kind not in _GGUF_ROPE_TYPES:
        raise ValueError(
            f"{meta.arch}.rope.scaling.type {kind!r} is not supported; supported: {_GGUF_ROPE_TYPES}"
        )
    factor = float(meta.require("{arch}.rope.scaling.factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    scaling: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": meta.require("{arch}.rope.scaling.original_context_length"),
    }
    attn_factor = meta.get("{arch}.rope.scaling.attn_factor")
    if attn_factor is not None:
        correction = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        scaling["attention_factor"] = float(attn_factor) * correction
    return scaling


def _context_length(meta: GgufMetadata) -> int:
    length = integer(meta.get("{arch}.context_length", 2048), f"{meta.arch}.context_length")
    if not 0 < length <= MAX_CONTEXT_LENGTH:
        raise ValueError(
            f"{meta.arch}.context_length {length} is not a context kvserve serves (1 to {MAX_CONTEXT_LENGTH} "
            "tokens)"
        )
    return length


# llama.cpp's names of a layer's tensors (after `blk.N.`) -> Hugging Face names (after `model.layers.N.`).
LLAMA_GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}
GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class Family:
    """One model family: everything the loader, the GGUF reader and the forward pass need to know
    about it. `name` is ModelConfig.architecture."""

    name: str
    hf_architectures: tuple[str, ...]
    # ModelConfig from a parsed config.json; raises ValueError (or KeyError for a missing field).
    config: Callable[[Mapping[str, Any]], ModelConfig]
    tensors: LayerTensors = LayerTensors()
    mlp: MlpBuilder = gated_mlp
    # Norm weights are stored as w and multiply by (norm_offset + w) (Gemma: 1). A GGUF stores
    # norm_offset + w (llama.cpp adds it when it converts), read as it is.
    norm_offset: float = 0.0
    # A checkpoint's tensor-name prefixes read as others (Qwen3.5's multimodal checkpoints hold the text
    # model under `model.language_model.`); names under no key are read as they are.
    hf_prefixes: Mapping[str, str] = field(default_factory=dict)
    # llama.cpp's `general.architecture` names this family reads, and its config.json from the metadata.
    gguf_architectures: tuple[str, ...] = ()
    gguf_config: Callable[[GgufMetadata], dict[str, Any]] | None = None
    gguf_layer: Mapping[str, str] = field(default_factory=lambda: LLAMA_GGUF_LAYER)
    gguf_global: Mapping[str, str] = field(default_factory=lambda: GGUF_GLOBAL)
    # llama.cpp interleaves the q and k rows of this architecture for its rotary kernel.
    gguf_permuted_qk: bool = False
    # Where transformers cannot read this architecture's GGUF tokenizer: the architecture it is read as.
    gguf_tokenizer_as: str = ""
    # llama.cpp's graph of this architecture divides its rope frequencies by a `rope_freqs.weight` tensor
    # where the file has one (how its converter writes Llama 3's scaling; gguf-py's ROPE_FREQS).
    gguf_rope_freqs: bool = False
    # The final norm's tensor (LFM2 calls it embedding_norm).
    final_norm: str = "model.norm.weight"
    # A recurrent layer's mixer (ModelConfig.mixers names which layers), from its tensors under the
    # layer's prefix `model.layers.{i}.`; None: every layer of this family attends.
    mixer: MixerBuilder | None = None
    # A recurrent layer's state as its config makes it (what the state pool is sized by; each mixer's
    # own spec must agree).
    state_spec: Callable[[ModelConfig, int, torch.dtype], StateSpec] | None = None
