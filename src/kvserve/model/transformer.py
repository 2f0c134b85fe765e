"""The Llama-family decoder forward pass: one varlen pass over every token scheduled in a step.

Weights keep Hugging Face names on load; q/k/v and gate/up are fused into one matmul each, since on
every device fewer, larger matmuls run faster than many small ones.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.errors import ModelLoadError
from kvserve.model.attention import AttentionMetadata, KVCache, paged_attention
from kvserve.model.rope import RotaryEmbedding, apply_rotary
from kvserve.model.spec import ModelConfig


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class Transformer:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        max_positions: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.config = config

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ModelLoadError(name, "tensor missing from the weight files")
            return weights[name].to(device=device, dtype=dtype)

        self.embed = take("model.embed_tokens.weight")
        self.norm = take("model.norm.weight")
        self.lm_head = self.embed if config.tie_word_embeddings else take("lm_head.weight")
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qkv_bias = None
            if config.attention_bias:
                qkv_bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            self.layers.append(
                LayerWeights(
                    attn_norm=take(p + "input_layernorm.weight"),
                    qkv=torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]).contiguous(),
                    qkv_bias=qkv_bias,
                    o=take(p + "self_attn.o_proj.weight"),
                    mlp_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
                    down=take(p + "mlp.down_proj.weight"),
                )
            )
        expected = (config.vocab_size, config.hidden_size)
        if tuple(self.embed.shape) != expected:
            raise ModelLoadError(
                "model.embed_tokens.weight",
                f"shape {tuple(self.embed.shape)} does not match config {expected}",
            )
        self.rotary = RotaryEmbedding(config, max_positions, device, dtype)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCache
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the last layer (before the final norm)."""
        c = self.config
        n = input_ids.shape[0]
        h = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary.tables(positions)
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.attn_norm, c.rms_norm_eps)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            q, k, v = torch.split(qkv, [self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rotary(q.view(n, c.num_heads, c.head_dim), cos, sin)
            k = apply_rotary(k.view(n, c.num_kv_heads, c.head_dim), cos, sin)
            v = v.reshape(n, c.num_kv_heads, c.head_dim)
            attn = paged_attention(q, k, v, kv.k[i], kv.v[i], meta, kv.block_size, self.scale)
            h = h + F.linear(attn.view(n, self.q_size), layer.o)
            x = rms_norm(h, layer.mlp_norm, c.rms_norm_eps)
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down)
        return h

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(hidden, self.norm, self.config.rms_norm_eps), self.lm_head)
