"""Qwen3-MoE: Qwen3's layers (q/k norms before rope) whose MLP is a sparse mixture of experts
(kvserve.model.moe) in the layers that `decoder_sparse_step` and `mlp_only_layers` pick, and the dense
SwiGLU MLP of `intermediate_size` in the others.

The experts' tensors: `mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj` and the router `mlp.gate`
in a Hugging Face folder (what transformers' save_pretrained writes); llama.cpp's 3-D `ffn_*_exps`
(one [experts, rows, in] tensor per product) and `ffn_gate_inp` in a GGUF, cut into the same per-expert
names as the file is read.
"""

from collections.abc import Mapping
from typing import Any

import torch

from kvserve.errors import ModelLoadError
from kvserve.model.families.base import Family, GgufMetadata, LayerTensors, gated_mlp, gguf_common_config
from kvserve.model.families.qwen3 import GGUF_LAYER as QWEN3_GGUF_LAYER
from kvserve.model.families.qwen3 import TENSORS
from kvserve.model.mlp import GatedMlp, Mlp
from kvserve.model.moe import SparseMoe
from kvserve.model.quant_linear import QuantLinear
from kvserve.model.spec import (
    ModelConfig,
    MoeConfig,
    decoder_config,
    layer_count,
    sliding_window,
    windows,
)
from kvserve.model.weights import ModelWeights, Rows

# `{expert}` stands for the expert's index: each 3-D tensor is read as one matrix per expert.
GGUF_LAYER = {
    **QWEN3_GGUF_LAYER,
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{expert}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{expert}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{expert}.down_proj.weight",
}


def moe_config(raw: Mapping[str, Any], layers: int) -> MoeConfig:
    # transformers' defaults where a field is absent; its save_pretrained writes num_experts as
    # num_local_experts.
    experts = int(raw.get("num_experts", raw.get("num_local_experts", 128)))
    top_k = int(raw.get("num_experts_per_tok", 8))
    step = int(raw.get("decoder_sparse_step", 1))
    dense = raw.get("mlp_only_layers") or []
    # No experts at all makes every layer dense, as in transformers.
    if experts < 0 or (experts and not 0 < top_k <= experts):
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and num_experts ({experts})")
    expert_size = int(raw.get("moe_intermediate_size", 768))
    if expert_size < 1:
        raise ValueError(f"moe_intermediate_size must be positive, not {expert_size}")
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be at least 1, not {step}")
    if any(not isinstance(i, int) or not 0 <= i < layers for i in dense):
        raise ValueError(f"mlp_only_layers must list layer indices below {layers}")
    return MoeConfig(
        num_experts=experts,
        top_k=top_k,
        expert_intermediate_size=expert_size,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        sparse_layers=tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers)),
    )


def _config(raw: Mapping[str, Any]) -> ModelConfig:
    layers = layer_count(raw)
    sliding = sliding_window(raw, default_on=False)
    return decoder_config(
        raw,
        "qwen3_moe",
        sliding_window=sliding,
        windows=windows(raw, layers, sliding),
        moe=moe_config(raw, layers),
    )


def _gguf_config(meta: GgufMetadata) -> dict[str, Any]:
    config = gguf_common_config(meta, "Qwen3MoeForCausalLM", "qwen3_moe")
    # llama.cpp's Qwen3-MoE graph makes every layer sparse and always renormalizes the chosen experts'
    # weights; it reads no key for either.
    config["num_experts"] = int(meta.require("{arch}.expert_count"))
    config["num_experts_per_tok"] = int(meta.require("{arch}.expert_used_count"))
    config["moe_intermediate_size"] = int(meta.require("{arch}.expert_feed_forward_length"))
    config["norm_topk_prob"] = True
    config["decoder_sparse_step"] = 1
    config["mlp_only_layers"] = []
    return config


def moe_mlp(weights: ModelWeights, config: ModelConfig, names: LayerTensors, prefix: str) -> Mlp:
    """The layer's MoE block, or its dense MLP where the layer is not sparse. `prefix` is
    `model.layers.{i}.`. The router's rows are the experts the weights hold: a count other than the
    config's, or an expert past it, is refused here, before any expert loads."""
    moe = config.moe
    assert moe is not None
    layer = int(prefix.split(".")[2])
    if not moe.sparse_layers[layer]:
        return gated_mlp(weights, config, names, prefix)
    hidden, inter = config.hidden_size, moe.expert_intermediate_size
    router_name = prefix + "mlp.gate.weight"
    if router_name not in weights.tensors:
        raise ModelLoadError(router_name, "tensor missing from the weight files")
    router_experts = int(weights.tensors[router_name].shape[0])
    beyond = f"{prefix}mlp.experts.{moe.num_experts}.gate_proj.weight"
    if router_experts != moe.num_experts or beyond in weights.tensors:
        found = router_experts if router_experts != moe.num_experts else f"more than {moe.num_experts}"
        raise ModelLoadError(
            prefix + "mlp",
            f"the config names {moe.num_experts} experts but the weights hold {found} (router "
            f"{router_name}, experts {prefix}mlp.experts.N)",
        )
    router = weights.tensor(router_name, (moe.num_experts, hidden))
    experts = []
    for e in range(moe.num_experts):
        p = f"{prefix}mlp.experts.{e}."
        gate = weights.linear([Rows(p + "gate_proj.weight", inter)], hidden)
        up = weights.linear([Rows(p + "up_proj.weight", inter)], hidden)
        down = weights.linear([Rows(p + "down_proj.weight", hidden)], inter)
        experts.append(GatedMlp(gate, up, down, config.hidden_act))
    # Where every expert's products are native, so is the routing (the one-call decoder's own function).
    products = [p for e in experts for p in (e.gate, e.up, e.down)]
    native = [p for p in products if isinstance(p, QuantLinear)]
    cpu32 = router.dtype == torch.float32 and router.device.type == "cpu"
    lib = native[0].lib if cpu32 and len(native) == len(products) else None
    return SparseMoe(router, experts, moe.top_k, moe.norm_topk_prob, lib)


QWEN3_MOE = Family(
    name="qwen3_moe",
    hf_architectures=("Qwen3MoeForCausalLM",),
    config=_config,
    tensors=TENSORS,
    mlp=moe_mlp,
    gguf_architectures=("qwen3moe",),
    gguf_config=_gguf_config,
    gguf_layer=GGUF_LAYER,
)
