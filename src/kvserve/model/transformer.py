"""The Llama-family decoder forward pass: one varlen pass over every token scheduled in a step.

Weights keep Hugging Face names on load. q/k/v are one matmul; the MLP's activation and product and
both residual adds ride on the matmuls that precede them. Every linear, the tied lm_head included, is
stored in `weight_dtype` (see kvserve.model.linear); the embedding lookup and the norms stay in `dtype`.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.errors import ModelLoadError
from kvserve.model.attention import AttentionBackend, AttentionMetadata, KVCache
from kvserve.model.linear import Linear, make_linear
from kvserve.model.native_attention import NativeAttention, NativeAttentionMetadata
from kvserve.model.native_build import KernelUnavailableError
from kvserve.model.native_decoder import DecoderLayer, NativeDecoder
from kvserve.model.quant_blocks import QuantizedWeight, concat
from kvserve.model.quant_linear import BlockArena, NativeRmsNorm, QuantLinear, make_block_linear
from kvserve.model.rope import RotaryEmbedding, apply_rotary
from kvserve.model.spec import ModelConfig


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: Linear
    o: Linear
    mlp_norm: torch.Tensor
    gate: Linear
    up: Linear
    down: Linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class Transformer:
    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        max_positions: int,
        device: torch.device,
        dtype: torch.dtype,
        weight_dtype: str,
        attention: AttentionBackend,
        quantized: dict[str, QuantizedWeight] | None = None,
        cache_dir: str = "",
        int16_decodes: bool = False,
    ) -> None:
        """`attention`: the backend every layer attends through; `quantized`: the file's blocks by weight
        name, for weight_dtype "gguf"; `cache_dir` holds the native kernels; `int16_decodes`: the native
        products take decode and logits rows with int16 activations (EngineConfig.decode_activations)."""
        self.config = config
        self.attention = attention
        blocks = quantized or {}
        arena = BlockArena()

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ModelLoadError(name, "tensor missing from the weight files")
            return weights[name].to(device=device, dtype=dtype)

        def product(names: list[str], bias: torch.Tensor | None) -> Linear:
            parts = [blocks.get(n) for n in names]
            joined = concat([p for p in parts if p is not None]) if all(parts) else None
            native = weight_dtype == "gguf" and device.type == "cpu" and dtype == torch.float32
            if native and joined is not None:
                # The float weights are read only for a fallback: not at all where the kernel runs.
                try:
                    return QuantLinear(joined, bias, cache_dir, int16_decodes, arena=arena)
                except KernelUnavailableError:
                    pass
            weight = torch.cat([take(n) for n in names]) if len(names) > 1 else take(names[0])
            if weight_dtype not in ("gguf", "q8_0"):
                return make_linear(weight, bias, weight_dtype)
            return make_block_linear(weight, bias, joined, weight_dtype, cache_dir, int16_decodes, arena)

        def linear(name: str, bias: bool) -> Linear:
            return product([name + ".weight"], take(name + ".bias") if bias else None)

        # The lookup reads the file's blocks where the products do (the same values as the float rows, a
        # quarter of their bytes for Q8_0): no float copy of the vocabulary stays resident.
        self.embed_blocks = blocks.get("model.embed_tokens.weight")
        if weight_dtype != "gguf" or device.type != "cpu":
            self.embed_blocks = None
        self.embed = None if self.embed_blocks is not None else take("model.embed_tokens.weight")
        self.dtype = dtype
        self.norm = take("model.norm.weight")
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        self.lm_head = product([head], None)
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qkv_bias = None
            if config.attention_bias:
                qkv_bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            self.layers.append(
                LayerWeights(
                    attn_norm=take(p + "input_layernorm.weight"),
                    qkv=product([p + f"self_attn.{n}_proj.weight" for n in "qkv"], qkv_bias),
                    o=linear(p + "self_attn.o_proj", config.o_proj_bias),
                    mlp_norm=take(p + "post_attention_layernorm.weight"),
                    gate=linear(p + "mlp.gate_proj", config.mlp_bias),
                    up=linear(p + "mlp.up_proj", config.mlp_bias),
                    down=linear(p + "mlp.down_proj", config.mlp_bias),
                )
            )
        expected = (config.vocab_size, config.hidden_size)
        if self.embed_blocks is not None:
            shape: tuple[int, ...] = (self.embed_blocks.out_features, self.embed_blocks.in_features)
        else:
            assert self.embed is not None
            shape = tuple(self.embed.shape)
        if shape != expected:
            raise ModelLoadError(
                "model.embed_tokens.weight", f"shape {shape} does not match config {expected}"
            )
        # Where the products run natively, so do the norms: one call each instead of five torch ops.
        self.rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = (
            NativeRmsNorm(cache_dir) if isinstance(self.lm_head, QuantLinear) else rms_norm
        )
        self.rotary = RotaryEmbedding(config, max_positions, device, dtype)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.cache_dir = cache_dir
        # The decode-only steps' native path, once a KV cache is attached (`attach_native_decoder`).
        self.decoder: NativeDecoder | None = None

    def attach_native_decoder(self, kv: KVCache) -> None:
        """Run steps of decodes only through one native call for every layer, over `kv`, where the
        products and the attention are native (gguf or q8_0 weights on the CPU in float32). Raises
        KernelUnavailableError when the decoder cannot serve this cache; the per-op path then serves every
        step."""
        if not isinstance(self.attention, NativeAttention):
            raise KernelUnavailableError("the native decoder calls the native attention kernel")
        products = [(layer.qkv, layer.o, layer.gate, layer.up, layer.down) for layer in self.layers]
        if not all(isinstance(p, QuantLinear) for ps in products for p in ps):
            raise KernelUnavailableError("the native decoder runs the native quantized products only")
        c = self.config
        layers: list[DecoderLayer] = []
        for layer in self.layers:
            qkv, o, gate, up, down = (layer.qkv, layer.o, layer.gate, layer.up, layer.down)
            assert isinstance(qkv, QuantLinear) and isinstance(o, QuantLinear)
            assert isinstance(gate, QuantLinear) and isinstance(up, QuantLinear)
            assert isinstance(down, QuantLinear)
            layers.append((layer.attn_norm, layer.mlp_norm, qkv, o, gate, up, down))
        dims = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, kv.block_size)
        self.decoder = NativeDecoder(
            layers, dims, c.rms_norm_eps, self.scale, self.rotary.cos, self.rotary.sin, kv, self.cache_dir
        )

    def embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows of `input_ids` [T] in the compute dtype, [T, hidden]."""
        if self.embed_blocks is not None:
            return self.embed_blocks.rows(input_ids).to(self.dtype)
        assert self.embed is not None
        return F.embedding(input_ids, self.embed)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCache
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the last layer (before the final norm)."""
        c = self.config
        n = input_ids.shape[0]
        d = meta.num_decodes
        h = self.embedding(input_ids)
        decoder = self.decoder
        if decoder is not None and decoder.kv is kv and not meta.num_prefills:
            # A decoder is attached only beside the native backend, so the step's metadata is that one's.
            attention = self.attention
            assert isinstance(attention, NativeAttention) and isinstance(meta, NativeAttentionMetadata)
            rows = meta.decode_rows
            assert rows is not None
            return decoder(h, positions, meta.slot_mapping, rows.tables, rows.lens, attention.kernel)
        cos, sin = self.rotary.tables(positions)
        for i, layer in enumerate(self.layers):
            x = self.rms_norm(h, layer.attn_norm, c.rms_norm_eps)
            qkv = layer.qkv(x, d)
            # q and k heads side by side, so one rotary pass covers both.
            qk = apply_rotary(qkv[:, : self.q_size + self.kv_size].view(n, -1, c.head_dim), cos, sin)
            q, k = torch.split(qk, [c.num_heads, c.num_kv_heads], dim=1)
            v = qkv[:, self.q_size + self.kv_size :].reshape(n, c.num_kv_heads, c.head_dim)
            attn = self.attention.forward(q, k, v, *kv.layer(i), meta, self.scale, self.config.window(i))
            h = layer.o.add(attn.view(n, self.q_size), h, d)
            x = self.rms_norm(h, layer.mlp_norm, c.rms_norm_eps)
            h = layer.down.add(layer.up.mul(x, layer.gate.silu(x, d), d), h, d)
        return h

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every row's logits, all taken as one-token rows: a token's logits are computed one way,
        whether it was a decode or ended a prefill."""
        x = self.rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        return self.lm_head(x, x.shape[0])
