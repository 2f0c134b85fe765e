"""Tiny Qwen3.5 configs and layers on random float32 weights, built by transformers' own classes, and the
same layers as kvserve builds them from the modules' state dicts."""

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from kvserve.model.families import qwen3_5
from kvserve.model.gated_deltanet import GatedDeltaNet, gated_deltanet
from kvserve.model.recurrent import SequenceRows
from kvserve.model.spec import ModelConfig
from kvserve.model.weights import ModelWeights

HIDDEN = 32
# The projections' scale: outputs of a few units, where float32 carries the 1e-5 the tests ask.
SCALE = 0.15
# Two key heads for four value heads: each key head serves two value heads.
TEXT: dict[str, Any] = dict(
    vocab_size=64,
    hidden_size=HIDDEN,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
)


def text_config(**overrides: Any) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(**{**TEXT, **overrides})


def model_config(hf: Qwen3_5TextConfig) -> ModelConfig:
    raw = hf.to_dict()
    raw["architectures"] = ["Qwen3_5ForCausalLM"]
    return qwen3_5.QWEN3_5.config(raw)


def reference_layer(hf: Qwen3_5TextConfig, seed: int = 0) -> Qwen3_5GatedDeltaNet:
    """transformers' layer 0 with every weight random: the decays spread over (0.01, 16), dt_bias and the
    gated norm's weight away from their initial ones."""
    torch.manual_seed(seed)
    layer = Qwen3_5GatedDeltaNet(hf, 0).float().eval()  # type: ignore[arg-type]
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":
                p.copy_(torch.empty_like(p).uniform_(0.01, 16).log())
            elif name == "norm.weight":
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(SCALE * torch.randn_like(p))
    return layer


def weights_of(state: dict[str, torch.Tensor], prefix: str = "model.layers.0.linear_attn.") -> ModelWeights:
    tensors = {prefix + name: t.detach().clone() for name, t in state.items()}
    return ModelWeights(tensors, {}, torch.device("cpu"), torch.float32, "float32", "", False)


def kvserve_layer(hf: Qwen3_5TextConfig, reference: Qwen3_5GatedDeltaNet) -> GatedDeltaNet:
    return gated_deltanet(weights_of(reference.state_dict()), model_config(hf), "model.layers.0.")


@dataclass
class Pool:
    """A state pool for one layer: every slot zero, as the pool hands a fresh sequence's slot."""

    conv: torch.Tensor
    delta: torch.Tensor

    @classmethod
    def for_layer(cls, layer: GatedDeltaNet, slots: int = 8) -> "Pool":
        conv_shape, delta_shape = layer.spec.shapes
        return cls(torch.zeros((slots, *conv_shape)), torch.zeros((slots, *delta_shape)))

    @property
    def states(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv, self.delta


def rows_of(lengths: list[int], slots: list[int]) -> SequenceRows:
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return SequenceRows(starts=starts, slots=torch.tensor(slots, dtype=torch.int64))


def run_in_calls(
    layer: GatedDeltaNet, x: torch.Tensor, cuts: list[int], pool: Pool, slot: int
) -> torch.Tensor:
    """x [T, hidden] as one sequence fed in the calls that `cuts` (increasing row indices) make."""
    bounds = [0, *cuts, x.shape[0]]
    pairs = itertools.pairwise(bounds)
    return torch.cat([layer.forward(x[a:b], rows_of([b - a], [slot]), pool.states) for a, b in pairs])


def _tile(t: torch.Tensor, dim: int, k_heads: int, per_k: int, width: int) -> torch.Tensor:
    """The value heads of t along `dim` from grouped by key head to tiled (how llama.cpp stores them)."""
    shape = list(t.shape)
    split = t.reshape(*shape[:dim], k_heads, per_k, width, *shape[dim + 1 :])
    return split.transpose(dim, dim + 1).reshape(shape)


def llamacpp_layout(state: dict[str, torch.Tensor], hf: Qwen3_5TextConfig) -> dict[str, torch.Tensor]:
    """A DeltaNet layer's tensors (its module's state dict) as llama.cpp's converter writes them, by the
    GGUF's names after `blk.N.`: value heads tiled, A as -exp(A_log), the convolution [C, K]."""
    sd = {k: v.detach().clone() for k, v in state.items()}
    nk, nv = hf.linear_num_key_heads, hf.linear_num_value_heads
    dk, dv, r = hf.linear_key_head_dim, hf.linear_value_head_dim, nv // nk
    q, k, v = torch.split(sd["in_proj_qkv.weight"], [nk * dk, nk * dk, nv * dv])
    cq, ck, cv = torch.split(sd["conv1d.weight"].squeeze(1), [nk * dk, nk * dk, nv * dv])

    def heads(t: torch.Tensor) -> torch.Tensor:
        return _tile(t.unsqueeze(1), 0, nk, r, 1).squeeze(1)

    return {
        "attn_qkv.weight": torch.cat((q, k, _tile(v, 0, nk, r, dv))),
        "attn_gate.weight": _tile(sd["in_proj_z.weight"], 0, nk, r, dv),
        "ssm_alpha.weight": _tile(sd["in_proj_a.weight"], 0, nk, r, 1),
        "ssm_beta.weight": _tile(sd["in_proj_b.weight"], 0, nk, r, 1),
        "ssm_out.weight": _tile(sd["out_proj.weight"], 1, nk, r, dv),
        "ssm_dt.bias": heads(sd["dt_bias"]),
        "ssm_a": heads(-sd["A_log"].exp()),
        "ssm_conv1d.weight": torch.cat((cq, ck, _tile(cv, 0, nk, r, dv))),
        "ssm_norm.weight": sd["norm.weight"],
    }
