"""Qwen3.5's gated full attention, as far as it differs from the shared attention step: q_proj yields, per
query head, the query's head_dim rows and then as many rows of an output gate; the attention's output is
multiplied by sigmoid(gate) before o_proj (`ModelConfig.attention_output_gate`). The rest is Qwen3's step:
q and k RMS-normed per head, then partial rope (`ModelConfig.partial_rotary_factor`, the first dimensions
of each head rotate; rope.apply_rotary passes the rest through).
"""

import ctypes

import torch

from kvserve.model.linear import Linear
from kvserve.model.spec import ModelConfig
from kvserve.model.weights import ModelWeights, Rows


def gated_qkv(weights: ModelWeights, config: ModelConfig, prefix: str, names: tuple[str, str, str]) -> Linear:
    """The layer's q (with its gate), k and v products as one matmul: rows [2 * heads * head_dim,
    kv_heads * head_dim, kv_heads * head_dim] of the checkpoint's q_proj, k_proj and v_proj (`names`,
    after `prefix`, before `.weight`), with their biases where `attention_bias` says so."""
    q_rows = 2 * config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    rows = (q_rows, kv_rows, kv_rows)
    parts = [Rows(prefix + name + ".weight", n) for name, n in zip(names, rows, strict=True)]
    bias = None
    if config.attention_bias:
        bias = torch.cat(
            [weights.tensor(prefix + name + ".bias", (n,)) for name, n in zip(names, rows, strict=True)]
        )
    return weights.linear(parts, config.hidden_size, bias)


def split_gated_qkv(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gated_qkv`'s output [T, (2 * heads + 2 * kv_heads) * head_dim] -> (qk [T, heads + kv_heads,
    head_dim], the q heads then the k heads as the attention step norms and rotates them; v [T, kv_heads,
    head_dim]; gate [T, heads * head_dim], in the attention output's order)."""
    n = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q_and_gate = qkv[:, : 2 * q_size].view(n, num_heads, 2, head_dim)
    k = qkv[:, 2 * q_size : 2 * q_size + kv_size].view(n, num_kv_heads, head_dim)
    qk = torch.cat((q_and_gate[:, :, 0], k), dim=1)
    v = qkv[:, 2 * q_size + kv_size :].view(n, num_kv_heads, head_dim)
    gate = q_and_gate[:, :, 1].reshape(n, q_size)
    return qk, v, gate


def gate_output(attn: torch.Tensor, gate: torch.Tensor, native: ctypes.CDLL | None = None) -> torch.Tensor:
    """The attention output [T, heads * head_dim] times sigmoid(gate), in place where attn allows it;
    through `native`'s `gate_rows` (the native decoder's own) for float32 rows where given."""
    if native is None or attn.dtype != torch.float32:
        return attn.mul_(torch.sigmoid(gate))
    out, gate = attn.contiguous(), gate.contiguous()
    native.gate_rows(out.data_ptr(), gate.data_ptr(), out.numel())
    return out
