"""gpt-oss (OpenAI's open-weight MoE): layers alternating a 128-token sliding window with global attention
(`layer_types`, else even layers slide), a learned attention sink per head (ModelConfig.attention_sinks),
biases on q, k, v and o, YaRN rope (unrounded correction range: `truncate: false`), and in every layer
a mixture of experts whose router has a bias and whose weights are the softmax over the top-k logits,
each expert a clamped SwiGLU with biases (kvserve.model.mlp.ClampedSwiGlu).

The experts' tensors: transformers keeps each layer's experts as 3-D tensors, `mlp.experts.gate_up_proj`
[experts, hidden, 2 * inter] (the gate and up columns interleaved) and `down_proj` [experts, inter,
hidden], each with a bias; they are cut here into per-expert matrices in the [out, in] layout, under the
names llama.cpp's GGUF answers (its `ffn_*_exps`, already split and in [experts, out, in]): one builder
serves both. In a GGUF the experts are MXFP4 blocks, read natively; OpenAI's own safetensors keep them
as MXFP4 `_blocks` and `_scales` tensors, whose codes and scales are moved into ggml's block layout at
load (`ggml_mxfp4`), so they are read natively too.
"""

from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import numpy as np
import torch

from kvserve.errors import ModelLoadError
from kvserve.model.families.base import (
    LLAMA_GGUF_LAYER,
    Family,
    GgufMetadata,
    LayerTensors,
    gguf_common_config,
)
from kvserve.model.linear import Linear
from kvserve.model.mlp import ClampedSwiGlu, Expert, Mlp
from kvserve.model.moe import SparseMoe
from kvserve.model.quant_blocks import MXFP4, QuantizedWeight
from kvserve.model.quant_linear import QuantLinear
from kvserve.model.spec import (
    ModelConfig,
    MoeConfig,
    decoder_config,
    integer,
    layer_count,
    layer_types,
    rope_scaling,
    rope_theta,
    window_size,
    windows,
)
from kvserve.model.weights import ModelWeights, Rows

TENSORS = LayerTensors(sinks="self_attn.sinks")
GGUF_LAYER = {
    # Llama's attention names; the MLP is the experts below.
    **{name: hf for name, hf in LLAMA_GGUF_LAYER.items() if name.startswith("attn_")},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    "ffn_gate_exps.weight": "mlp.experts.{expert}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{expert}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{expert}.down_proj.weight",
    "ffn_gate_exps.bias": "mlp.experts.{expert}.gate_proj.bias",
    "ffn_up_exps.bias": "mlp.experts.{expert}.up_proj.bias",
    "ffn_down_exps.bias": "mlp.experts.{expert}.down_proj.bias",
}
# transformers' GptOssConfig defaults for what a config.json may leave out.
_THETA = 150000.0
_WINDOW = 128
_YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
# llama.cpp's gpt-oss graph fixes the clamped SwiGLU's constants; no GGUF key holds them.
_ALPHA = 1.702
_LIMIT = 7.0


def _types(raw: Mapping[str, Any], layers: int) -> list[str]:
    types = layer_types(raw, layers)
    if types is not None:
        return types
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]


def _moe(raw: Mapping[str, Any], layers: int) -> MoeConfig:
    experts = integer(raw.get("num_local_experts", raw.get("num_experts", 128)), "num_local_experts")
    top_k = integer(raw.get("num_experts_per_tok", 4), "num_experts_per_tok")
    if not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and num_local_experts ({experts})")
    alpha = float(raw.get("swiglu_alpha", _ALPHA))
    limit = float(raw.get("swiglu_limit", _LIMIT))
    if not (0 < alpha < 1e4 and 0 < limit < 1e4):
        raise ValueError(f"swiglu_alpha {alpha} and swiglu_limit {limit} must be finite and positive")
    return MoeConfig(
        num_experts=experts,
        top_k=top_k,
        expert_intermediate_size=integer(raw["intermediate_size"], "intermediate_size"),
        norm_topk_prob=True,
        sparse_layers=(True,) * layers,
        clamped_swiglu=(alpha, limit),
    )


def _config(raw: Mapping[str, Any]) -> ModelConfig:
    layers = layer_count(raw)
    types = _types(raw, layers)
    sliding = window_size(raw.get("sliding_window", _WINDOW))
    scaled = raw.get("rope_scaling") or {
        k: v for k, v in (raw.get("rope_parameters") or {}).items() if k != "rope_theta"
    }
    _, scaling = rope_scaling({"rope_scaling": scaled or _YARN})
    bias = bool(raw.get("attention_bias", True))
    return decoder_config(
        raw,
        "gpt_oss",
        head_dim=integer(raw.get("head_dim") or 64, "head_dim"),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=integer(
            raw.get("max_position_embeddings", 131072), "max_position_embeddings"
        ),
        rope_theta=rope_theta(raw, _THETA),
        rope_scaling=scaling,
        attention_bias=bias,
        o_proj_bias=bias,
        sliding_window=sliding,
        windows=windows({"layer_types": types}, layers, sliding),
        moe=_moe(raw, layers),
        attention_sinks=True,
    )


def _gguf_config(meta: GgufMetadata) -> dict[str, Any]:
    config = gguf_common_config(meta, "GptOssForCausalLM", "gpt_oss")
    config["num_local_experts"] = int(meta.require("{arch}.expert_count"))
    config["num_experts_per_tok"] = int(meta.require("{arch}.expert_used_count"))
    config["intermediate_size"] = int(
        meta.get("{arch}.expert_feed_forward_length", config["intermediate_size"])
    )
    config["sliding_window"] = int(meta.get("{arch}.attention.sliding_window", _WINDOW))
    config["rope_theta"] = float(meta.get("{arch}.rope.freq_base", _THETA))
    # llama.cpp's graph slides on the even layers, as transformers' default layer_types does.
    config["layer_types"] = _types({}, config["num_hidden_layers"])
    scaling = config.get("rope_scaling")
    if scaling is not None and scaling.get("rope_type") == "yarn":
        config["rope_scaling"] = {**scaling, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
    else:
        config["rope_scaling"] = {"rope_type": "default"}
    return config


V = TypeVar("V")


class _Overlay(Mapping[str, V]):
    """`top`'s values, then `base`'s (read when asked for, as `base` reads them)."""

    def __init__(self, top: Mapping[str, V], base: Mapping[str, V]) -> None:
        self.top = top
        self.base = base

    def __getitem__(self, name: str) -> V:
        return self.top[name] if name in self.top else self.base[name]

    def __contains__(self, name: object) -> bool:
        return name in self.top or name in self.base

    def __iter__(self) -> Iterator[str]:
        yield from self.top
        yield from (n for n in self.base if n not in self.top)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _Dequantized(Mapping[str, torch.Tensor]):
    """MXFP4 matrices' float values, dequantized when asked for (a product on float weights only)."""

    def __init__(self, blocks: Mapping[str, QuantizedWeight]) -> None:
        self.blocks = blocks

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.blocks[name].dequantize()

    def __iter__(self) -> Iterator[str]:
        return iter(self.blocks)

    def __len__(self) -> int:
        return len(self.blocks)


def _packed(weights: ModelWeights, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A uint8 tensor of OpenAI's MXFP4 checkpoint, checked."""
    if name not in weights.tensors:
        raise ModelLoadError(name, "tensor missing from the weight files")
    t = weights.tensors[name]
    if t.dtype != torch.uint8 or tuple(t.shape) != shape:
        raise ModelLoadError(name, f"{t.dtype} {tuple(t.shape)} is not MXFP4's uint8 {shape}")
    return t.numpy()


def ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OpenAI's MXFP4 rows (blocks [rows, n, 16]: byte j holds weights 2j in its low nibble and 2j + 1
    in its high one; scales [rows, n], E8M0) as ggml's MXFP4 rows [rows, n * 17] (the scale byte, then
    weights i and i + 16 in byte i's low and high nibbles): the same codes and scales, moved."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([scales[..., None], qs], axis=-1).reshape(blocks.shape[0], -1)


def _openai_experts(weights: ModelWeights, prefix: str, moe: MoeConfig, hidden: int) -> ModelWeights:
    """`weights` answering the per-expert names from OpenAI's MXFP4 expert tensors (`*_blocks` and
    `*_scales`, the gate and up rows interleaved): as the file's blocks in ggml's layout (products on
    them natively with weight_dtype gguf) and as their float values otherwise."""
    p = prefix + "mlp.experts."
    experts, inter = moe.num_experts, moe.expert_intermediate_size
    if hidden % 32 or inter % 32:
        raise ModelLoadError(p + "gate_up_proj_blocks", "MXFP4 rows need multiples of 32 weights")
    gu_blocks = _packed(weights, p + "gate_up_proj_blocks", (experts, 2 * inter, hidden // 32, 16))
    gu_scales = _packed(weights, p + "gate_up_proj_scales", (experts, 2 * inter, hidden // 32))
    dn_blocks = _packed(weights, p + "down_proj_blocks", (experts, hidden, inter // 32, 16))
    dn_scales = _packed(weights, p + "down_proj_scales", (experts, hidden, inter // 32))
    gate_up_bias = weights.tensor(p + "gate_up_proj_bias", (experts, 2 * inter))
    down_bias = weights.tensor(p + "down_proj_bias", (experts, hidden))
    blocks: dict[str, QuantizedWeight] = {}
    biases: dict[str, torch.Tensor] = {}
    for e in range(experts):
        q = f"{p}{e}."
        for name, rows, scales, n_in in (
            ("gate_proj", gu_blocks[e, 0::2], gu_scales[e, 0::2], hidden),
            ("up_proj", gu_blocks[e, 1::2], gu_scales[e, 1::2], hidden),
            ("down_proj", dn_blocks[e], dn_scales[e], inter),
        ):
            data = torch.from_numpy(np.ascontiguousarray(ggml_mxfp4(rows, scales)))
            blocks[q + name + ".weight"] = QuantizedWeight(MXFP4, data, n_in)
        biases[q + "gate_proj.bias"] = gate_up_bias[e, 0::2]
        biases[q + "up_proj.bias"] = gate_up_bias[e, 1::2]
        biases[q + "down_proj.bias"] = down_bias[e]
    floats = _Overlay(biases, _Dequantized(blocks))
    return ModelWeights(
        _Overlay(floats, weights.tensors),
        _Overlay(blocks, weights.blocks),
        weights.device,
        weights.dtype,
        weights.weight_dtype,
        weights.cache_dir,
        weights.int16_activations,
        weights.norm_offset,
    )


def _split_experts(weights: ModelWeights, prefix: str, moe: MoeConfig, hidden: int) -> ModelWeights:
    """`weights` answering the per-expert names where the layer holds transformers' 3-D expert tensors
    (cut and transposed here, as views); as they are otherwise (a GGUF's per-expert names)."""
    p = prefix + "mlp.experts."
    if p + "gate_up_proj_blocks" in weights.tensors:
        return _openai_experts(weights, prefix, moe, hidden)
    if p + "gate_up_proj" not in weights.tensors:
        return weights
    experts, inter = moe.num_experts, moe.expert_intermediate_size
    gate_up = weights.tensor(p + "gate_up_proj", (experts, hidden, 2 * inter))
    gate_up_bias = weights.tensor(p + "gate_up_proj_bias", (experts, 2 * inter))
    down = weights.tensor(p + "down_proj", (experts, inter, hidden))
    down_bias = weights.tensor(p + "down_proj_bias", (experts, hidden))
    cut: dict[str, torch.Tensor] = {}
    for e in range(experts):
        q = f"{p}{e}."
        cut[q + "gate_proj.weight"] = gate_up[e, :, 0::2].T
        cut[q + "up_proj.weight"] = gate_up[e, :, 1::2].T
        cut[q + "gate_proj.bias"] = gate_up_bias[e, 0::2]
        cut[q + "up_proj.bias"] = gate_up_bias[e, 1::2]
        cut[q + "down_proj.weight"] = down[e].T
        cut[q + "down_proj.bias"] = down_bias[e]
    return ModelWeights(
        _Overlay(cut, weights.tensors),
        weights.blocks,
        weights.device,
        weights.dtype,
        weights.weight_dtype,
        weights.cache_dir,
        weights.int16_activations,
        weights.norm_offset,
    )


def _mlp(weights: ModelWeights, config: ModelConfig, names: LayerTensors, prefix: str) -> Mlp:
    """The layer's MoE block: the router (with its bias) and every expert, each checked against the
    config's count before any loads."""
    moe = config.moe
    assert moe is not None and moe.clamped_swiglu is not None
    hidden, inter = config.hidden_size, moe.expert_intermediate_size
    router_name = prefix + "mlp.router.weight"
    if router_name not in weights.tensors:
        raise ModelLoadError(router_name, "tensor missing from the weight files")
    router_experts = int(weights.tensors[router_name].shape[0])
    if router_experts != moe.num_experts:
        raise ModelLoadError(
            router_name, f"the config names {moe.num_experts} experts but the router has {router_experts}"
        )
    router = weights.tensor(router_name, (moe.num_experts, hidden))
    router_bias = weights.tensor(prefix + "mlp.router.bias", (moe.num_experts,))
    w = _split_experts(weights, prefix, moe, hidden)
    alpha, limit = moe.clamped_swiglu
    linears: list[tuple[Linear, Linear, Linear]] = []
    for e in range(moe.num_experts):
        p = f"{prefix}mlp.experts.{e}."
        gate = w.linear(
            [Rows(p + "gate_proj.weight", inter)], hidden, w.tensor(p + "gate_proj.bias", (inter,))
        )
        up = w.linear([Rows(p + "up_proj.weight", inter)], hidden, w.tensor(p + "up_proj.bias", (inter,)))
        down = w.linear(
            [Rows(p + "down_proj.weight", hidden)], inter, w.tensor(p + "down_proj.bias", (hidden,))
        )
        linears.append((gate, up, down))
    # Where every expert's products are native, so are the routing and the activation (the one-call
    # decoder's own functions).
    native = [p for products in linears for p in products if isinstance(p, QuantLinear)]
    cpu32 = router.dtype == torch.float32 and router.device.type == "cpu"
    lib = native[0].lib if cpu32 and len(native) == 3 * len(linears) else None
    experts: list[Expert] = [ClampedSwiGlu(*products, alpha, limit, lib) for products in linears]
    return SparseMoe(router, experts, moe.top_k, moe.norm_topk_prob, lib, router_bias)


GPT_OSS = Family(
    name="gpt_oss",
    hf_architectures=("GptOssForCausalLM",),
    config=_config,
    tensors=TENSORS,
    mlp=_mlp,
    gguf_architectures=("gpt-oss",),
    gguf_config=_gguf_config,
    gguf_layer=GGUF_LAYER,
    # transformers reads no gpt-oss GGUF tokenizer; its o200k BPE is a GPT-2-style one, read as Qwen2's.
    gguf_tokenizer_as="qwen2",
)
