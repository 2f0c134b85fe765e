"""The decoder forward pass of every supported family: one varlen pass over every token scheduled in a step.

Weights keep Hugging Face names on load; each family (model/families/) names its tensors and which
shared pieces its layers use (q/k norms, post norms, NoPE or local-rope layers, a gated MLP or another
`Mlp`). q/k/v are one matmul; the MLP's activation and product and both residual adds ride on the
matmuls that precede them where the layer has no post norm. Every linear, the tied lm_head included, is
stored in `weight_dtype` (see kvserve.model.linear); the embedding lookup and the norms stay in `dtype`.
"""

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.errors import ModelLoadError
from kvserve.model.attention import AttentionBackend, AttentionMetadata, KVCache
from kvserve.model.families import family_named
from kvserve.model.gated_attention import gate_output, split_gated_qkv
from kvserve.model.linear import Linear
from kvserve.model.mlp import GatedMlp, Mlp
from kvserve.model.native_attention import NativeAttention, NativeAttentionMetadata
from kvserve.model.native_build import KernelUnavailableError
from kvserve.model.native_decoder import DecoderLayer, NativeDecoder
from kvserve.model.quant_blocks import QuantizedWeight
from kvserve.model.quant_linear import NativeRmsNorm, QuantLinear
from kvserve.model.recurrent import RecurrentMixer, RecurrentState, SequenceRows, StateSpec
from kvserve.model.rope import RotaryEmbedding, apply_rotary
from kvserve.model.spec import MIXER_ATTENTION, ROPE_GLOBAL, ROPE_NONE, ModelConfig
from kvserve.model.weights import ModelWeights, Rows


@dataclass
class LayerWeights:
    """One decoder layer: its norms, what it mixes tokens with (its qkv and o products, or a recurrent
    `mixer`), its MLP, the rope it takes (an index into Transformer.ropes; None for a NoPE layer) and its
    attention window (None: global)."""

    attn_norm: torch.Tensor
    qkv_proj: Linear | None
    o_proj: Linear | None
    mlp_norm: torch.Tensor
    mlp: Mlp
    rope: int | None = 0
    window: int | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None
    # A recurrent layer's mixer (kvserve.model.recurrent); None: the layer attends.
    mixer: RecurrentMixer | None = None

    @property
    def qkv(self) -> Linear:
        if self.qkv_proj is None:
            raise AttributeError("a recurrent layer has no qkv product")
        return self.qkv_proj

    @property
    def o(self) -> Linear:
        if self.o_proj is None:
            raise AttributeError("a recurrent layer has no o product")
        return self.o_proj

    # Each query head's sink logit [heads] (ModelConfig.attention_sinks).
    sinks: torch.Tensor | None = None

    def _gated(self) -> GatedMlp:
        if not isinstance(self.mlp, GatedMlp):
            raise AttributeError("this layer's MLP has no gate, up and down products")
        return self.mlp

    # The dense MLP's products, for the tools and tests that wrap or inspect them.
    @property
    def gate(self) -> Linear:
        return self._gated().gate

    @gate.setter
    def gate(self, value: Linear) -> None:
        self._gated().gate = value

    @property
    def up(self) -> Linear:
        return self._gated().up

    @up.setter
    def up(self, value: Linear) -> None:
        self._gated().up = value

    @property
    def down(self) -> Linear:
        return self._gated().down

    @down.setter
    def down(self, value: Linear) -> None:
        self._gated().down = value


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
        quantized: Mapping[str, QuantizedWeight] | None = None,
        cache_dir: str = "",
        int16_activations: bool = False,
        norms_hold_offset: bool = False,
        rope_rows: int | None = None,
    ) -> None:
        """`attention`: the backend every layer attends through; `quantized`: the file's blocks by weight
        name, for weight_dtype "gguf"; `cache_dir` holds the native kernels; `int16_activations`: the native
        products take every row with int16 activations (EngineConfig.activations);
        `norms_hold_offset`: the norm weights hold the family's norm_offset already (a GGUF's do);
        `rope_rows`: the positions the rope tables hold (default `max_positions`)."""
        self.config = config
        self.attention = attention
        family = family_named(config.architecture)
        blocks: Mapping[str, QuantizedWeight] = quantized if quantized is not None else {}
        norm_offset = 0.0 if norms_hold_offset else family.norm_offset
        w = ModelWeights(
            weights, blocks, device, dtype, weight_dtype, cache_dir, int16_activations, norm_offset
        )
        c = config
        hidden, head_dim = c.hidden_size, c.head_dim
        self.q_size = c.num_heads * head_dim
        self.kv_size = c.num_kv_heads * head_dim

        # The lookup reads the file's blocks where the products do (the same values as the float rows, a
        # quarter of their bytes for Q8_0): no float copy of the vocabulary stays resident.
        self.embed_blocks: QuantizedWeight | QuantLinear | None = blocks.get("model.embed_tokens.weight")
        if weight_dtype != "gguf" or device.type != "cpu":
            self.embed_blocks = None
        elif self.embed_blocks is not None and dtype == torch.float32:
            # The kernel dequantizes the looked-up rows in place (a prefill's thousands of them).
            with contextlib.suppress(KernelUnavailableError):
                self.embed_blocks = QuantLinear(self.embed_blocks, None, cache_dir)
        self.embed = None if self.embed_blocks is not None else w.tensor("model.embed_tokens.weight")
        # Gemma scales the embedding rows by sqrt(hidden), the factor rounded to the compute dtype.
        self.embed_scale = torch.tensor(hidden**0.5).to(dtype) if c.scale_embeddings else None
        self.dtype = dtype
        self.norm = w.norm(family.final_norm, hidden)
        head = "model.embed_tokens.weight" if c.tie_word_embeddings else "lm_head.weight"
        self.lm_head = w.linear([Rows(head, c.vocab_size)], hidden)
        # One rope table per kind the layers take (global, and Gemma's local base for sliding layers).
        kinds = sorted({c.rope(i) for i in range(c.num_layers)} - {ROPE_NONE}, key=lambda k: k != ROPE_GLOBAL)
        self.ropes = [RotaryEmbedding(c, max_positions, device, dtype, kind, rope_rows) for kind in kinds]
        names = family.tensors
        self.layers: list[LayerWeights] = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."

            def norm(name: str | None, size: int = hidden, p: str = p) -> torch.Tensor | None:
                return None if name is None else w.norm(p + name + ".weight", size)

            if c.mixer(i) != MIXER_ATTENTION:
                attn_norm, mlp_norm = norm(names.attn_norm), norm(names.mlp_norm)
                assert attn_norm is not None and mlp_norm is not None and family.mixer is not None
                mixer = family.mixer(w, c, p)
                self.layers.append(
                    LayerWeights(
                        attn_norm, None, None, mlp_norm, family.mlp(w, c, names, p), None, mixer=mixer
                    )
                )
                continue
            qkv_rows = [self.q_size * (2 if c.attention_output_gate else 1), self.kv_size, self.kv_size]
            if len(names.qkv) == 1:
                qkv_parts = [Rows(p + names.qkv[0] + ".weight", sum(qkv_rows))]
                qkv_bias_names = [(names.qkv[0], sum(qkv_rows))]
            else:
                qkv_parts = [Rows(p + n + ".weight", r) for n, r in zip(names.qkv, qkv_rows, strict=True)]
                qkv_bias_names = list(zip(names.qkv, qkv_rows, strict=True))
            qkv_bias = None
            if c.attention_bias:
                qkv_bias = torch.cat([w.tensor(p + n + ".bias", (r,)) for n, r in qkv_bias_names])
            o_bias = w.tensor(p + names.o + ".bias", (hidden,)) if c.o_proj_bias else None
            kind = c.rope(i)
            attn_norm, mlp_norm = norm(names.attn_norm), norm(names.mlp_norm)
            assert attn_norm is not None and mlp_norm is not None
            self.layers.append(
                LayerWeights(
                    attn_norm=attn_norm,
                    qkv_proj=w.linear(qkv_parts, hidden, qkv_bias),
                    o_proj=w.linear([Rows(p + names.o + ".weight", hidden)], self.q_size, o_bias),
                    mlp_norm=mlp_norm,
                    mlp=family.mlp(w, c, names, p),
                    rope=None if kind == ROPE_NONE else kinds.index(kind),
                    window=c.window(i),
                    q_norm=norm(names.q_norm, head_dim),
                    k_norm=norm(names.k_norm, head_dim),
                    post_attn_norm=norm(names.post_attn_norm),
                    post_mlp_norm=norm(names.post_mlp_norm),
                    sinks=w.tensor(p + names.sinks, (c.num_heads,))
                    if c.attention_sinks and names.sinks
                    else None,
                )
            )
        expected = (c.vocab_size, hidden)
        if self.embed_blocks is not None:
            eb = self.embed_blocks
            blocks_of = eb.weight if isinstance(eb, QuantLinear) else eb
            shape: tuple[int, ...] = (blocks_of.out_features, blocks_of.in_features)
        else:
            assert self.embed is not None
            shape = tuple(self.embed.shape)
        if shape != expected:
            raise ModelLoadError(
                "model.embed_tokens.weight", f"shape {shape} does not match config {expected}"
            )
        if self.embed_blocks is not None and c.tie_word_embeddings and isinstance(self.lm_head, QuantLinear):
            # The tied head reads the same rows: the lookup goes through it.
            self.embed_blocks = self.lm_head
        # Where the products run natively, so do the norms: one call each instead of five torch ops (the
        # layers' products decide, not only the head's: a file's head may be of a type the kernel lacks).
        native = [self.lm_head, *(p for layer in self.layers[:1] for p in (layer.qkv_proj,) if p is not None)]
        self.rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = (
            NativeRmsNorm(cache_dir) if any(isinstance(p, QuantLinear) for p in native) else rms_norm
        )
        # The products' library where the norms are native: the ops the native decoder has and torch's
        # are not bitwise (the output gate's sigmoid) run through it on both paths.
        self._native_lib = self.rms_norm.lib if isinstance(self.rms_norm, NativeRmsNorm) else None
        self.scale = c.attention_scale
        self.cache_dir = cache_dir
        # The decode-only steps' native path, once a KV cache is attached (`attach_native_decoder`).
        self.decoder: NativeDecoder | None = None
        # Each layer's index among the attention layers (its KV cache layer); None for a recurrent layer.
        attending = c.attention_layers
        self.kv_layer = [attending.index(i) if i in attending else None for i in range(c.num_layers)]

    @property
    def rotary(self) -> RotaryEmbedding:
        """The model's (global) rope."""
        return self.ropes[0]

    def attach_native_decoder(self, kv: KVCache, state: RecurrentState | None = None) -> None:
        """Run steps of decodes only through one native call for every layer, over `kv` (and a hybrid
        model's recurrent `state`), where the products, the norms and the attention are native (gguf or
        q8_0 weights on the CPU in float32). Raises KernelUnavailableError when the decoder cannot serve
        this cache; the per-op path then serves every step."""
        if not isinstance(self.attention, NativeAttention):
            raise KernelUnavailableError("the native decoder calls the native attention kernel")
        if not isinstance(self.rms_norm, NativeRmsNorm):
            raise KernelUnavailableError("the native decoder runs where the norms are native")
        c = self.config
        if c.hybrid and state is None:
            raise KernelUnavailableError("a hybrid model's native decoder needs its recurrent state")
        layers: list[DecoderLayer] = []
        for i, layer in enumerate(self.layers):
            kv_layer = self.kv_layer[i]
            k_cache, v_cache = kv.layer(kv_layer) if kv_layer is not None else (None, None)
            rope = None if layer.rope is None else self.ropes[layer.rope]
            layers.append(
                DecoderLayer(
                    attn_norm=layer.attn_norm,
                    mlp_norm=layer.mlp_norm,
                    qkv=layer.qkv_proj,
                    o=layer.o_proj,
                    mlp=layer.mlp,
                    rope=None if rope is None else (rope.cos, rope.sin),
                    k_cache=k_cache,
                    v_cache=v_cache,
                    window=layer.window,
                    q_norm=layer.q_norm if layer.k_norm is not None else None,
                    k_norm=layer.k_norm if layer.q_norm is not None else None,
                    post_attn_norm=layer.post_attn_norm,
                    post_mlp_norm=layer.post_mlp_norm,
                    sinks=layer.sinks,
                    output_gate=c.attention_output_gate and layer.mixer is None,
                    mixer=layer.mixer,
                    state=() if state is None else state.layer(i),
                )
            )
        # The rotated dimensions as apply_rotary takes them: twice the tables' width.
        rotary_dim = 2 * self.rotary.cos.shape[-1]
        if rotary_dim > c.head_dim:
            raise KernelUnavailableError(f"a rotary dim of {rotary_dim} past the head's {c.head_dim}")
        dims = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, rotary_dim, kv.block_size)
        self.decoder = NativeDecoder(layers, dims, c.rms_norm_eps, self.scale, kv, self.cache_dir)

    def embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows of `input_ids` [T] in the compute dtype, [T, hidden]."""
        if self.embed_blocks is not None:
            return self.embed_blocks.rows(input_ids).to(self.dtype)
        assert self.embed is not None
        return F.embedding(input_ids, self.embed)

    def state_specs(self) -> list[StateSpec | None]:
        """Each layer's recurrent state spec (None for an attention layer), what `RecurrentState` holds."""
        return [None if layer.mixer is None else layer.mixer.spec for layer in self.layers]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVCache,
        rows: SequenceRows | None = None,
        state: RecurrentState | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the last layer (before the final norm). A hybrid model's
        recurrent layers take the step's rows by sequence (`rows`) and their state (`state`)."""
        c = self.config
        n = input_ids.shape[0]
        d = meta.num_decodes
        h = self.embedding(input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        decoder = self.decoder
        # The decoder takes every step of an attention-only model, prefill chunks included (each token
        # one row, as the kernels give each row its bits alone), and a hybrid model's steps where each
        # sequence is one row in a slot of its own (a prefill, or a decode with drafts, runs op by op: its
        # recurrent layers take a sequence's rows in order).
        one_row_each = rows is None or (rows.num_sequences == n and len(set(rows.slots.tolist())) == n)
        takes = rows is None or not meta.num_prefills
        if decoder is not None and decoder.kv is kv and takes and one_row_each:
            # A decoder is attached only beside the native backend, so the step's metadata is that one's.
            attention = self.attention
            assert isinstance(attention, NativeAttention) and isinstance(meta, NativeAttentionMetadata)
            step_tables, lens = meta.step_rows()
            # The sliding layers' group: its own tables and slots, or the global ones where ids are shared.
            sliding = meta.sliding or meta
            assert isinstance(sliding, NativeAttentionMetadata)
            return decoder(
                h,
                positions,
                meta.slot_mapping,
                step_tables,
                sliding.slot_mapping,
                step_tables if sliding is meta else sliding.step_rows()[0],
                lens,
                attention.kernel,
                None if rows is None else rows.slots,
            )
        tables = [rope.tables(positions) for rope in self.ropes]
        eps = c.rms_norm_eps
        for i, layer in enumerate(self.layers):
            x = self.rms_norm(h, layer.attn_norm, eps)
            if layer.mixer is not None:
                assert rows is not None and state is not None, (
                    "a hybrid model's step needs its sequences' states"
                )
                h = h + layer.mixer.forward(x, rows, state.layer(i))
                h = self._mlp(layer, h, d)
                continue
            qkv = layer.qkv(x, d)
            gate = None
            if c.attention_output_gate:
                qk, v, gate = split_gated_qkv(qkv, c.num_heads, c.num_kv_heads, c.head_dim)
            else:
                # q and k heads side by side, so one norm call each and one rotary pass cover them.
                qk = qkv[:, : self.q_size + self.kv_size].view(n, -1, c.head_dim)
                v = qkv[:, self.q_size + self.kv_size :].reshape(n, c.num_kv_heads, c.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q_normed = self.rms_norm(qk[:, : c.num_heads], layer.q_norm, eps)
                qk = torch.cat((q_normed, self.rms_norm(qk[:, c.num_heads :], layer.k_norm, eps)), dim=1)
            if layer.rope is not None:
                qk = apply_rotary(qk, *tables[layer.rope])
            q, k = torch.split(qk, [c.num_heads, c.num_kv_heads], dim=1)
            kv_layer = self.kv_layer[i]
            assert kv_layer is not None
            attn = self.attention.forward(
                q, k, v, *kv.layer(kv_layer), meta, self.scale, c.window(i), layer.sinks
            )
            if gate is not None:
                attn = gate_output(attn.reshape(n, self.q_size), gate, self._native_lib)
            if layer.post_attn_norm is None:
                h = layer.o.add(attn.view(n, self.q_size), h, d)
            else:
                h = h + self.rms_norm(layer.o(attn.view(n, self.q_size), d), layer.post_attn_norm, eps)
            h = self._mlp(layer, h, d)
        return h

    def _mlp(self, layer: LayerWeights, h: torch.Tensor, d: int) -> torch.Tensor:
        """The layer's MLP on `h` (after its norm), added to `h`; `d` decode rows."""
        eps = self.config.rms_norm_eps
        x = self.rms_norm(h, layer.mlp_norm, eps)
        if layer.post_mlp_norm is None:
            return layer.mlp.add(x, h, d)
        return h + self.rms_norm(layer.mlp(x, d), layer.post_mlp_norm, eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every row's logits, all taken as one-token rows: a token's logits are computed one way,
        whether it was a decode or ended a prefill."""
        x = self.rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        return self.lm_head(x, x.shape[0])
