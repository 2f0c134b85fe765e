"""Every decoder layer of a step's decode rows in one native call (`decoder_layers` in
kernels/decoder.c).

The per-op path runs about ninety torch ops and ctypes calls per layer and token (norms, products, rope's
eight ops, two K/V writes with their casts, views); on a small model they cost as much as the products.
This path runs the same operations in the same order inside one C function, so its bits are the per-op
path's (tests/model/test_native_decoder_matches_per_op.py compares them) and a decode stays
batch-invariant. Every layer kind the families load runs here: q/k norms, post norms, GeGLU or SwiGLU,
biases, partial rotary, NoPE layers and per-layer rope tables, sliding-window layers over their own
group of the cache, attention sinks and output gates, mixtures of experts (with a router bias and
gpt-oss's clamped SwiGLU, or a shared expert), and the recurrent layers (LFM2's short convolution,
Qwen3.5's Gated DeltaNet), whose state the step updates in place in each row's slot of the state pool.
Where the per-op path has no native op of its own (the clamped SwiGLU, the output gate, the recurrent
step) it calls the decoder's functions, so both paths keep one set of bits. It serves steps of decodes
only, one row per sequence, on the CPU in float32 with gguf or q8_0 weights and the native attention
kernel; every other step, and every other setting, takes the per-op path, which stays the reference.
"""

import ctypes
from dataclasses import dataclass

import torch

from kvserve.model.attention import KVCache
from kvserve.model.gated_deltanet import GatedDeltaNet
from kvserve.model.kernel_abi import (
    ACT_CLAMPED_SWIGLU,
    ACTIVATIONS,
    KV_TYPES,
    DecoderLayerStruct,
    DecoderStruct,
    QLinearStruct,
)
from kvserve.model.linear import Linear
from kvserve.model.mlp import ClampedSwiGlu, Expert, GatedMlp, Mlp
from kvserve.model.moe import SparseMoe
from kvserve.model.native_attention import PagedAttentionKernel
from kvserve.model.native_build import KernelUnavailableError
from kvserve.model.quant_linear import QuantLinear, load_library
from kvserve.model.recurrent import RecurrentMixer
from kvserve.model.shared_expert import SharedExpertMoe
from kvserve.model.short_conv import ShortConv


@dataclass
class DecoderLayer:
    """What the decoder reads of one layer: its norms (None where it has none), its products and MLP, its
    rope tables (None: a NoPE layer), its caches in its group, its window (None: global), its sinks and
    output gate; or, for a recurrent layer, its `mixer` and that layer's state tensors in the pool."""

    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: Linear | None
    o: Linear | None
    mlp: Mlp
    rope: tuple[torch.Tensor, torch.Tensor] | None
    k_cache: torch.Tensor | None
    v_cache: torch.Tensor | None
    window: int | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    output_gate: bool = False
    mixer: RecurrentMixer | None = None
    state: tuple[torch.Tensor, ...] = ()


def _native(linear: Linear | None) -> QuantLinear:
    if not isinstance(linear, QuantLinear):
        raise KernelUnavailableError("the native decoder runs the native quantized products only")
    return linear


def _qlinear(linear: Linear | None) -> QLinearStruct:
    return _native(linear).struct


def _ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise KernelUnavailableError(
            "the native decoder reads contiguous float32 norms, rope tables and routers"
        )
    return int(t.data_ptr())


def _activation(mlp: Expert) -> int:
    if isinstance(mlp, ClampedSwiGlu):
        return ACT_CLAMPED_SWIGLU
    if mlp.activation not in ACTIVATIONS:
        raise KernelUnavailableError(f"the native decoder has no {mlp.activation} activation")
    return ACTIVATIONS[mlp.activation]


class NativeDecoder:
    """The decoder layers of one Transformer over one KV cache, for steps of decodes only.

    Holds pointers into the Transformer's weights, rope tables and the cache: it lives as long as they do.
    """

    def __init__(
        self,
        layers: list[DecoderLayer],
        dims: tuple[int, int, int, int, int, int],
        eps: float,
        scale: float,
        kv: KVCache,
        cache_dir: str,
    ) -> None:
        """`dims`: hidden, heads, kv_heads, head_dim, rotary_dim, block_size."""
        self.lib = load_library(cache_dir)
        hidden, heads, kv_heads, head_dim, rotary_dim, block_size = dims
        k_dtype = kv.k.dtype
        if k_dtype not in KV_TYPES:
            raise KernelUnavailableError(
                f"the native decoder takes a float32, float16 or q8_0 cache, not {k_dtype}"
            )
        if k_dtype != torch.float32 and not self.lib.decoder_layers_kv16():
            raise KernelUnavailableError("this C compiler has no _Float16: no float16 or q8_0 cache writes")
        self.kv = kv
        # The experts' product arrays, which the layer structs point into.
        self._expert_arrays: list[ctypes.Array[QLinearStruct]] = []
        structs = [self._layer(layer) for layer in layers]
        modes = {p.int16 for layer in layers for p in self._products(layer)}
        if len(modes) > 1:
            raise KernelUnavailableError("the native decoder runs every product with one activation mode")
        self._layers = (DecoderLayerStruct * len(structs))(*structs)
        self._keep = layers
        self._decoder = DecoderStruct(
            len(layers),
            hidden,
            heads,
            kv_heads,
            head_dim,
            rotary_dim,
            block_size,
            KV_TYPES[k_dtype],
            int(modes.pop()) if modes else 0,
            eps,
            scale,
            self._layers,
        )

    @staticmethod
    def _products(layer: DecoderLayer) -> list[QuantLinear]:
        mlp = layer.mlp
        shared = [mlp.shared] if isinstance(mlp, SharedExpertMoe) else []
        routed = mlp.routed if isinstance(mlp, SharedExpertMoe) else mlp
        dense = [mlp] if isinstance(mlp, GatedMlp) else []
        experts = routed.experts if isinstance(routed, SparseMoe) else dense
        gated = [e for e in experts if isinstance(e, (GatedMlp, ClampedSwiGlu))]
        if len(gated) != len(experts):
            raise KernelUnavailableError("the native decoder runs gated experts only")
        mixer = layer.mixer
        mixing: list[Linear | None]
        if isinstance(mixer, ShortConv):
            mixing = [mixer.in_proj, mixer.out_proj]
        elif isinstance(mixer, GatedDeltaNet):
            mixing = [mixer.qkv, mixer.z, mixer.b, mixer.a, mixer.out]
        else:
            mixing = [layer.qkv, layer.o]
        linears = [*mixing, *(p for e in [*gated, *shared] for p in (e.gate, e.up, e.down))]
        return [_native(p) for p in linears]

    def _layer(self, layer: DecoderLayer) -> DecoderLayerStruct:
        for cache in (layer.k_cache, layer.v_cache):
            if cache is not None and (not cache.is_contiguous() or cache.dtype != self.kv.k.dtype):
                raise KernelUnavailableError("the native decoder writes contiguous caches of one format")
        cos, sin = layer.rope if layer.rope is not None else (None, None)
        struct = DecoderLayerStruct(
            attn_norm=_ptr(layer.attn_norm),
            mlp_norm=_ptr(layer.mlp_norm),
            q_norm=_ptr(layer.q_norm),
            k_norm=_ptr(layer.k_norm),
            post_attn_norm=_ptr(layer.post_attn_norm),
            post_mlp_norm=_ptr(layer.post_mlp_norm),
            cos=_ptr(cos),
            sin=_ptr(sin),
            k_cache=None if layer.k_cache is None else layer.k_cache.data_ptr(),
            v_cache=None if layer.v_cache is None else layer.v_cache.data_ptr(),
            window=layer.window or 0,
            sinks=_ptr(layer.sinks),
            output_gate=int(layer.output_gate),
        )
        self._mixer(struct, layer)
        mlp = layer.mlp
        shared = None
        if isinstance(mlp, SharedExpertMoe):
            shared = mlp.shared
            struct.shared_gate = _ptr(mlp.gate)
            mlp = mlp.routed
        if isinstance(mlp, GatedMlp):
            struct.act = _activation(mlp)
            struct.gate, struct.up, struct.down = _qlinear(mlp.gate), _qlinear(mlp.up), _qlinear(mlp.down)
        elif isinstance(mlp, SparseMoe):
            experts = [e for e in mlp.experts if isinstance(e, (GatedMlp, ClampedSwiGlu))]
            struct.act = _activation(experts[0])
            if any(_activation(e) != struct.act for e in experts):
                raise KernelUnavailableError("the native decoder runs one activation for every expert")
            if struct.act == ACT_CLAMPED_SWIGLU:
                first = experts[0]
                assert isinstance(first, ClampedSwiGlu)
                limits = {(e.alpha, e.limit) for e in experts if isinstance(e, ClampedSwiGlu)}
                if len(limits) != 1 or first.native is None:
                    raise KernelUnavailableError("the native decoder runs one clamped SwiGLU, natively")
                struct.alpha, struct.limit = first.alpha, first.limit
            if shared is not None:
                if _activation(shared) != struct.act:
                    raise KernelUnavailableError("a shared expert of another kind than its experts'")
                struct.gate, struct.up = _qlinear(shared.gate), _qlinear(shared.up)
                struct.down = _qlinear(shared.down)
            products = [_qlinear(p) for e in experts for p in (e.gate, e.up, e.down)]
            array = (QLinearStruct * len(products))(*products)
            self._expert_arrays.append(array)
            struct.experts, struct.top_k = len(mlp.experts), mlp.top_k
            struct.norm_topk, struct.router = int(mlp.norm_topk_prob), _ptr(mlp.router)
            struct.router_bias = _ptr(mlp.router_bias)
            struct.expert_products = array
        else:
            raise KernelUnavailableError(f"the native decoder has no {type(mlp).__name__} block")
        return struct

    @staticmethod
    def _mixer(struct: DecoderLayerStruct, layer: DecoderLayer) -> None:
        """The layer's token mixing: attention's products, or a recurrent mixer's and its state."""
        mixer = layer.mixer
        if mixer is None:
            struct.qkv, struct.o = _qlinear(layer.qkv), _qlinear(layer.o)
            return
        if not isinstance(mixer, (ShortConv, GatedDeltaNet)) or mixer.native is None:
            raise KernelUnavailableError(f"the native decoder has no native {type(mixer).__name__} step")
        for t in layer.state:
            if t.dtype != torch.float32 or not t.is_contiguous():
                raise KernelUnavailableError("the native decoder updates contiguous float32 states")
        struct.mixer = mixer.native.struct
        struct.conv_state = layer.state[0].data_ptr()
        if isinstance(mixer, ShortConv):
            struct.qkv, struct.o = _qlinear(mixer.in_proj), _qlinear(mixer.out_proj)
        else:
            struct.qkv, struct.o = _qlinear(mixer.qkv), _qlinear(mixer.out)
            struct.z, struct.beta, struct.dt = _qlinear(mixer.z), _qlinear(mixer.b), _qlinear(mixer.a)
            struct.delta_state = layer.state[1].data_ptr()

    def __call__(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        sliding_slots: torch.Tensor,
        sliding_tables: torch.Tensor,
        lens: torch.Tensor,
        attention: PagedAttentionKernel,
        state_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """h [rows, hidden] float32 (updated in place and returned); positions, slots, lens [rows] and
        tables [rows, width] int64, contiguous; sliding_slots and sliding_tables the same rows in the
        sliding layers' group (the global ones where the groups share their ids); state_slots [rows]:
        each row's recurrent state slot, distinct (a hybrid model's)."""
        assert h.is_contiguous() and h.dtype == torch.float32
        status = self.lib.decoder_layers(
            ctypes.byref(self._decoder),
            h.data_ptr(),
            h.shape[0],
            positions.data_ptr(),
            slots.data_ptr(),
            tables.data_ptr(),
            tables.shape[1],
            sliding_slots.data_ptr(),
            sliding_tables.data_ptr(),
            sliding_tables.shape[1],
            lens.data_ptr(),
            None if state_slots is None else state_slots.data_ptr(),
            attention.address,
            torch.get_num_threads(),
        )
        if status == -2:
            raise MemoryError("the native decoder could not allocate its scratch memory")
        if status != 0:
            raise ValueError("the native decoder refused this model's shapes")
        return h
