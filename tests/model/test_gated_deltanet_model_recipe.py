"""The whole Qwen3.5 text model (dense and MoE) assembled from kvserve's pieces as the forward pass is to
assemble them, against transformers' own model's logits to 1e-4: a 70-token prompt in one call (past a
64-token chunk), then one token at a time. The recipe here is the contract for the Transformer's
per-layer dispatch:

- per layer: x = rms_norm(h) with (1 + w) weights; a DeltaNet layer's mixer (`qwen3_5.mixer`, where
  `GatedDeltaNetConfig.layers` says) or the gated attention; h += that; then
  h = mlp.add(rms_norm(h), h) (the post norm (1 + w) too);
- the gated attention: `gated_qkv` -> `split_gated_qkv` -> q/k norms ((1 + w)) over the q heads then the
  k heads -> rope on the first `rotary_dim` dimensions -> attention (scale head_dim ** -0.5) ->
  `gate_output` -> o_proj;
- the final norm ((1 + w)) and lm_head.
"""

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from kvserve.model.families import qwen3_5
from kvserve.model.families.base import Family
from kvserve.model.families.qwen3_5 import QWEN3_5, QWEN3_5_MOE
from kvserve.model.gated_attention import gate_output, gated_qkv, split_gated_qkv
from kvserve.model.gated_deltanet import GatedDeltaNet
from kvserve.model.linear import Linear
from kvserve.model.mlp import Mlp
from kvserve.model.rope import RotaryEmbedding, apply_rotary
from kvserve.model.spec import ModelConfig
from kvserve.model.weights import ModelWeights, Rows
from tests.model.deltanet_cases import TEXT, Pool, rows_of, text_config

pytestmark = pytest.mark.usefixtures("one_thread")

QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")


@dataclass
class Attention:
    qkv: Linear
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: Linear
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


@dataclass
class Layer:
    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    mlp: Mlp
    mixer: GatedDeltaNet | Attention
    pool: Pool | None


class Recipe:
    """One sequence through the model, call after call, its states in the layers' pools (slot 0) and
    its keys and values in lists."""

    def __init__(self, family: Family, config: ModelConfig, state: dict[str, torch.Tensor]) -> None:
        cpu, offset = torch.device("cpu"), family.norm_offset
        w = ModelWeights(state, {}, cpu, torch.float32, "float32", "", False, offset)
        c = self.config = config
        self.embed = w.tensor("model.embed_tokens.weight")
        self.norm = w.norm("model.norm.weight", c.hidden_size)
        self.lm_head = w.linear([Rows("lm_head.weight", c.vocab_size)], c.hidden_size)
        self.rope = RotaryEmbedding(c, 256, torch.device("cpu"), torch.float32)
        assert c.deltanet is not None
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            mixer: GatedDeltaNet | Attention
            if c.deltanet.layers[i]:
                mixer = qwen3_5.mixer(w, c, p)
            else:
                mixer = Attention(
                    gated_qkv(w, c, p, QKV),
                    w.norm(p + "self_attn.q_norm.weight", c.head_dim),
                    w.norm(p + "self_attn.k_norm.weight", c.head_dim),
                    w.linear([Rows(p + "self_attn.o_proj.weight", c.hidden_size)], c.num_heads * c.head_dim),
                    [],
                    [],
                )
            pool = Pool.for_layer(mixer, slots=1) if isinstance(mixer, GatedDeltaNet) else None
            self.layers.append(
                Layer(
                    w.norm(p + "input_layernorm.weight", c.hidden_size),
                    w.norm(p + "post_attention_layernorm.weight", c.hidden_size),
                    family.mlp(w, c, family.tensors, p),
                    mixer,
                    pool,
                )
            )
        self.position = 0

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        c, eps, n = self.config, self.config.rms_norm_eps, ids.shape[0]
        positions = torch.arange(self.position, self.position + n)
        self.position += n
        h = F.embedding(ids, self.embed)
        for layer in self.layers:
            x = F.rms_norm(h, (c.hidden_size,), layer.attn_norm, eps)
            if isinstance(layer.mixer, GatedDeltaNet):
                assert layer.pool is not None
                mixed = layer.mixer.forward(x, rows_of([n], [0]), layer.pool.states)
            else:
                mixed = self._attend(layer.mixer, x, positions)
            h = h + mixed
            h = layer.mlp.add(F.rms_norm(h, (c.hidden_size,), layer.mlp_norm, eps), h)
        return self.lm_head(F.rms_norm(h, (c.hidden_size,), self.norm, eps))

    def _attend(self, a: Attention, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c, eps, n, heads = self.config, self.config.rms_norm_eps, x.shape[0], self.config.num_heads
        qk, v, gate = split_gated_qkv(a.qkv(x), heads, c.num_kv_heads, c.head_dim)
        qk = torch.cat(
            (
                F.rms_norm(qk[:, :heads], (c.head_dim,), a.q_norm, eps),
                F.rms_norm(qk[:, heads:], (c.head_dim,), a.k_norm, eps),
            ),
            dim=1,
        )
        qk = apply_rotary(qk, *self.rope.tables(positions))
        a.keys.append(qk[:, heads:])
        a.values.append(v)
        k, v_all = torch.cat(a.keys), torch.cat(a.values)
        total = k.shape[0]
        mask = torch.ones(n, total, dtype=torch.bool).tril(total - n)
        attn = F.scaled_dot_product_attention(
            qk[:, :heads].transpose(0, 1),
            k.transpose(0, 1),
            v_all.transpose(0, 1),
            attn_mask=mask,
            scale=c.head_dim**-0.5,
            enable_gqa=True,
        )
        return a.o(gate_output(attn.transpose(0, 1).reshape(n, heads * c.head_dim), gate))


def randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 16).log())
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model.float().eval()


MOE: dict[str, Any] = {
    **{k: v for k, v in TEXT.items() if k != "intermediate_size"},
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 12,
    "shared_expert_intermediate_size": 20,
}


def _models() -> dict[str, tuple[Family, Any, Any]]:
    return {
        "dense": (QWEN3_5, Qwen3_5ForCausalLM, text_config()),
        "moe": (QWEN3_5_MOE, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig(**MOE)),
    }


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory 3-D experts as the per-expert matrices its checkpoints hold."""
    out = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, inter = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name.removesuffix('down_proj')}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_the_model_from_its_pieces_matches_transformers(kind: str) -> None:
    family, model_class, hf = _models()[kind]
    hf.layer_types = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    model = randomized(model_class(hf), seed=4)
    state = per_expert({k: v.detach().clone() for k, v in model.state_dict().items()})
    config = family.config({**hf.to_dict(), "architectures": [family.hf_architectures[0]]})
    recipe = Recipe(family, config, state)
    ids = torch.randint(0, hf.vocab_size, (76,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model(ids.unsqueeze(0)).logits[0]
    got = [recipe(ids[:70])] + [recipe(ids[i : i + 1]) for i in range(70, 76)]
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=1e-4)
