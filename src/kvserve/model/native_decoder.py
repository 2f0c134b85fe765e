"""Every decoder layer of a step's decode rows in one native call (`decoder_layers` in
kernels/decoder.c).

The per-op path runs about ninety torch ops and ctypes calls per layer and token (norms, products, rope's
eight ops, two K/V writes with their casts, views); on a small model they cost as much as the products.
This path runs the same operations in the same order inside one C function, so its bits are the per-op
path's (tests/model/test_native_decoder_matches_per_op.py compares them) and a decode stays
batch-invariant. It serves steps of decodes only, on the CPU in float32 with gguf or q8_0 weights and the
native attention kernel; every other step, and every other setting, takes the per-op path, which stays
the reference.
"""

import ctypes

import torch

from kvserve.model.attention import KVCache
from kvserve.model.kernel_abi import KV_TYPES, DecoderLayerStruct, DecoderStruct, QLinearStruct
from kvserve.model.native_attention import PagedAttentionKernel
from kvserve.model.native_build import KernelUnavailableError
from kvserve.model.quant_linear import QuantLinear, load_library

# A layer's attention norm, MLP norm, and its qkv, o, gate, up and down products.
DecoderLayer = tuple[
    torch.Tensor, torch.Tensor, QuantLinear, QuantLinear, QuantLinear, QuantLinear, QuantLinear
]


def _qlinear(linear: QuantLinear) -> QLinearStruct:
    return linear.struct


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
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: KVCache,
        cache_dir: str,
    ) -> None:
        self.lib = load_library(cache_dir)
        if len({p.int16_decodes for layer in layers for p in layer[2:]}) > 1:
            raise KernelUnavailableError("the native decoder runs every product with one activation mode")
        hidden, heads, kv_heads, head_dim, intermediate, block_size = dims
        k_cache, v_cache = kv.k, kv.v
        if k_cache.dtype not in KV_TYPES or not k_cache.is_contiguous():
            raise KernelUnavailableError(
                f"the native decoder takes a float32, float16 or q8_0 cache, not {k_cache.dtype}"
            )
        if k_cache.dtype != torch.float32 and not self.lib.decoder_layers_kv16():
            raise KernelUnavailableError("this C compiler has no _Float16: no float16 or q8_0 cache writes")
        assert v_cache.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
        self.kv = kv
        self._keep = (cos, sin)
        self._layers = (DecoderLayerStruct * len(layers))(
            *(
                DecoderLayerStruct(
                    attn.data_ptr(),
                    mlp.data_ptr(),
                    _qlinear(qkv),
                    _qlinear(o),
                    _qlinear(g),
                    _qlinear(u),
                    _qlinear(d),
                )
                for attn, mlp, qkv, o, g, u, d in layers
            )
        )
        self._decoder = DecoderStruct(
            len(layers),
            hidden,
            heads,
            kv_heads,
            head_dim,
            intermediate,
            block_size,
            k_cache.shape[1],
            KV_TYPES[k_cache.dtype],
            int(layers[0][2].int16_decodes) if layers else 0,
            eps,
            scale,
            self._layers,
            cos.data_ptr(),
            sin.data_ptr(),
        )
        self._k, self._v = k_cache.data_ptr(), v_cache.data_ptr()

    def __call__(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
        attention: PagedAttentionKernel,
    ) -> torch.Tensor:
        """h [rows, hidden] float32 (updated in place and returned); positions, slots, lens [rows] and
        tables [rows, width] int64, contiguous."""
        assert h.is_contiguous() and h.dtype == torch.float32
        status = self.lib.decoder_layers(
            ctypes.byref(self._decoder),
            h.data_ptr(),
            h.shape[0],
            positions.data_ptr(),
            slots.data_ptr(),
            self._k,
            self._v,
            tables.data_ptr(),
            tables.shape[1],
            lens.data_ptr(),
            attention.address,
            torch.get_num_threads(),
        )
        if status == -2:
            raise MemoryError("the native decoder could not allocate its scratch memory")
        if status != 0:
            raise ValueError("the native decoder refused this model's shapes")
        return h
