"""Qwen3.5's other layer pieces against transformers' own modules on tiny random float32 weights, to 1e-5:
the gated full attention (q_proj's output gate, q/k norms of (1 + w), partial rope through kvserve's rope
tables) and the MoE block with its shared expert; and the families' configs."""

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention, Qwen3_5TextRotaryEmbedding
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

from kvserve.errors import ModelLoadError
from kvserve.model.families import qwen3_5
from kvserve.model.families.base import LayerTensors
from kvserve.model.gated_attention import gate_output, gated_qkv, split_gated_qkv
from kvserve.model.loader import load_weights
from kvserve.model.rope import RotaryEmbedding, apply_rotary
from kvserve.model.shared_expert import SharedExpertMoe
from kvserve.model.weights import ModelWeights
from tests.model.deltanet_cases import TEXT, model_config, text_config

# Tiny layers: one thread avoids a hand-off per small op.
pytestmark = pytest.mark.usefixtures("one_thread")

# The multimodal rope's sections, which give text the plain rope.
ROPE = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 2]}


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def randomize(module: torch.nn.Module, seed: int, scale: float = 0.2) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(scale * torch.randn_like(p))


@pytest.mark.parametrize("bias", [False, True])
def test_gated_attention_matches_transformers(bias: bool) -> None:
    hf = text_config(head_dim=32, rope_parameters=ROPE, attention_bias=bias)
    hf._attn_implementation = "eager"
    reference = Qwen3_5Attention(hf, 3).float().eval()  # type: ignore[arg-type]
    randomize(reference, 0)
    config = model_config(hf)
    assert config.attention_output_gate and config.rotary_dim == 8
    prefix = "model.layers.3.self_attn."
    tensors = {prefix + k: v.detach().clone() for k, v in reference.state_dict().items()}
    weights = ModelWeights(tensors, {}, torch.device("cpu"), torch.float32, "float32", "", False, 1.0)
    names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    qkv = gated_qkv(weights, config, "model.layers.3.", names)
    q_norm = weights.norm(prefix + "q_norm.weight", 32)
    k_norm = weights.norm(prefix + "k_norm.weight", 32)
    o_weight = weights.tensor(prefix + "o_proj.weight")
    o_bias = weights.tensor(prefix + "o_proj.bias") if bias else None

    n, heads, kv_heads, eps = 20, 4, 2, config.rms_norm_eps
    x = torch.randn(n, hf.hidden_size, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(n)

    qk, v, gate = split_gated_qkv(qkv(x), heads, kv_heads, 32)
    qk = torch.cat(
        (F.rms_norm(qk[:, :heads], (32,), q_norm, eps), F.rms_norm(qk[:, heads:], (32,), k_norm, eps)), dim=1
    )
    qk = apply_rotary(qk, *RotaryEmbedding(config, 64, torch.device("cpu"), torch.float32).tables(positions))
    q, k = qk[:, :heads], qk[:, heads:]
    attn = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    )
    out = F.linear(gate_output(attn.transpose(0, 1).reshape(n, heads * 32), gate), o_weight, o_bias)

    cos, sin = Qwen3_5TextRotaryEmbedding(hf)(x, positions.unsqueeze(0))
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected, _ = reference(x.unsqueeze(0), (cos, sin), mask)
    close(out, expected[0])
    # Without the gate the output differs: the test sees it.
    ungated = F.linear(attn.transpose(0, 1).reshape(n, heads * 32), o_weight, o_bias)
    assert not torch.allclose(ungated, expected[0], atol=1e-3)


MOE: dict[str, Any] = {
    **{k: v for k, v in TEXT.items() if k != "intermediate_size"},
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 12,
    "shared_expert_intermediate_size": 20,
}


def moe_weights(block: Qwen3_5MoeSparseMoeBlock, prefix: str = "model.layers.0.mlp.") -> ModelWeights:
    """The block's tensors under the names transformers' save_pretrained writes (one matrix per expert)."""
    sd = {k: v.detach().clone() for k, v in block.state_dict().items()}
    gate_up, down = sd.pop("experts.gate_up_proj"), sd.pop("experts.down_proj")
    inter = gate_up.shape[1] // 2
    tensors = {prefix + k: v for k, v in sd.items()}
    for e in range(gate_up.shape[0]):
        tensors[f"{prefix}experts.{e}.gate_proj.weight"] = gate_up[e, :inter]
        tensors[f"{prefix}experts.{e}.up_proj.weight"] = gate_up[e, inter:]
        tensors[f"{prefix}experts.{e}.down_proj.weight"] = down[e]
    return ModelWeights(tensors, {}, torch.device("cpu"), torch.float32, "float32", "", False, 1.0)


@pytest.mark.parametrize("rows", [1, 9])
def test_moe_block_with_its_shared_expert_matches_transformers(rows: int) -> None:
    hf = Qwen3_5MoeTextConfig(**MOE)
    block = Qwen3_5MoeSparseMoeBlock(hf).float().eval()  # type: ignore[no-untyped-call]
    randomize(block, 2, scale=0.3)
    raw = {**hf.to_dict(), "architectures": ["Qwen3_5MoeForCausalLM"]}
    config = qwen3_5.QWEN3_5_MOE.config(raw)
    mlp = qwen3_5.QWEN3_5_MOE.mlp(moe_weights(block), config, LayerTensors(), "model.layers.0.")
    assert isinstance(mlp, SharedExpertMoe)
    x = torch.randn(rows, hf.hidden_size, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        expected = block(x.unsqueeze(0))[0]
    close(mlp(x), expected)
    residual = torch.randn_like(x)
    close(mlp.add(x, residual), expected + residual)
    # The shared expert's gate is what scales it: without it the output differs.
    assert not torch.allclose(mlp.routed(x) + mlp.shared(x), expected, atol=1e-3)


def test_family_configs_from_config_json() -> None:
    dense = model_config(text_config(layer_types=None, full_attention_interval=2, num_hidden_layers=4))
    assert dense.deltanet is not None and dense.deltanet.layers == (True, False, True, False)
    assert dense.partial_rotary_factor == 0.25 and dense.rotary_dim == 4 and dense.attention_output_gate
    assert (dense.deltanet.conv_dim, dense.deltanet.v_heads_tiled) == (2 * 16 + 32, False)
    nested = {"architectures": ["Qwen3_5ForCausalLM"], "text_config": text_config().to_dict()}
    assert qwen3_5.QWEN3_5.config(nested) == model_config(text_config())
    moe = qwen3_5.QWEN3_5_MOE.config({**Qwen3_5MoeTextConfig(**MOE).to_dict(), "architectures": ["X"]})
    assert moe.moe is not None and moe.moe.shared_expert_intermediate_size == 20
    assert moe.moe.norm_topk_prob and all(moe.moe.sparse_layers)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
        ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}, "layer_types"),
        ({"linear_num_value_heads": 3}, "multiple"),
        ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim"),
        ({"linear_key_head_dim": 1 << 20}, "linear_key_head_dim"),
        ({"full_attention_interval": 0, "layer_types": None}, "full_attention_interval"),
    ],
)
def test_family_config_refuses_bad_fields(change: dict[str, Any], message: str) -> None:
    raw = {**text_config().to_dict(), "architectures": ["Qwen3_5ForCausalLM"], **change}
    if raw.get("layer_types") is None:
        raw.pop("layer_types")
    with pytest.raises(ValueError, match=message):
        qwen3_5.QWEN3_5.config(raw)


def test_a_multimodal_checkpoints_text_model_is_read_under_the_text_names(tmp_path: Path) -> None:
    """The released checkpoints (`Qwen3_5ForConditionalGeneration`) hold the text model under
    `model.language_model.`: read as `model.`, the rest as stored; two tensors under one name refused."""
    one = torch.ones(2)
    names = ("model.language_model.layers.0.a", "lm_head.weight", "mtp.fc.weight")
    save_file({name: torch.ones(2) for name in names}, tmp_path / "a.safetensors")
    weights = load_weights(str(tmp_path), qwen3_5.QWEN3_5.hf_prefixes)
    assert sorted(weights) == ["lm_head.weight", "model.layers.0.a", "mtp.fc.weight"]
    torch.testing.assert_close(weights["model.layers.0.a"], one)
    nested = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text_config().to_dict()}
    assert qwen3_5.QWEN3_5.config(nested) == model_config(text_config())
    save_file({"model.layers.0.a": one}, tmp_path / "b.safetensors")
    with pytest.raises(ModelLoadError, match="both read as"):
        load_weights(str(tmp_path), qwen3_5.QWEN3_5.hf_prefixes)
