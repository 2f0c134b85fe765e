"""The C kernels' interface on the Python side: the one place that mirrors kernels/kvserve.h in ctypes.

Two libraries are built from the kernels' sources (`LINEAR`, `ATTENTION`), each from its own list of files
and with its own flags. Both export `kvserve_abi_version` and `kvserve_struct_sizes`; `check_abi` compares
them with `ABI_VERSION` and the sizes of the ctypes structures below and refuses a library that disagrees
before any other symbol is bound, so a header changed without this module (or the reverse) stops the load
with a KernelAbiError instead of passing misread arguments. A change to a struct, a signature or a
constant here bumps ABI_VERSION together with KVSERVE_ABI_VERSION in kvserve.h.
"""

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.errors import KernelAbiError

ABI_VERSION = 9

_P = ctypes.c_void_p
_I = ctypes.c_int64
_C = ctypes.c_int

# The op quant_linear applies to each output after the bias (OP_* in kvserve.h).
OP_NONE, OP_ADD, OP_MUL = 0, 1, 2
# The gated MLP's activation (ACT_* in kvserve.h), by its config name.
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}
# gpt-oss's clamped SwiGLU (ACT_CLAMPED_SWIGLU), which no config names as an activation.
ACT_CLAMPED_SWIGLU = 2
# A layer's token mixer (MIXER_* in kvserve.h), by kvserve.model.spec's mixer kinds.
MIXER_KINDS = {"attention": 0, "short_conv": 1, "gated_deltanet": 2}
# The most parts one product holds (QLINEAR_PARTS in kvserve.h).
QLINEAR_PARTS = 4


class QPartStruct(ctypes.Structure):
    """struct qpart: one part of a product, its rows in place."""

    _fields_ = [("type", _I), ("w", _P), ("bias", _P), ("n_out", _I)]


class QLinearStruct(ctypes.Structure):
    """struct qlinear: one product of one or more parts, their outputs side by side."""

    _fields_ = [("n_parts", _I), ("n_in", _I), ("n_out", _I), ("parts", QPartStruct * QLINEAR_PARTS)]


class MixerStruct(ctypes.Structure):
    """struct mixer: a recurrent layer's decode step past its input products (`mixer_rows`)."""

    _fields_ = [
        ("kind", _I),
        ("channels", _I),
        ("kernel", _I),
        ("conv", _P),
        ("conv_bias", _P),
        ("k_heads", _I),
        ("v_heads", _I),
        ("k_dim", _I),
        ("v_dim", _I),
        ("tiled", _I),
        ("decay", _P),
        ("dt_bias", _P),
        ("norm", _P),
        ("eps", ctypes.c_double),
    ]


class DecoderLayerStruct(ctypes.Structure):
    """struct decoder_layer: a layer's norms (NULL where it has none), rope tables (NULL: NoPE), caches,
    window, activation, sinks, products, experts, and a recurrent layer's mixer and state."""

    _fields_ = [
        ("attn_norm", _P),
        ("mlp_norm", _P),
        ("q_norm", _P),
        ("k_norm", _P),
        ("post_attn_norm", _P),
        ("post_mlp_norm", _P),
        ("cos", _P),
        ("sin", _P),
        ("k_cache", _P),
        ("v_cache", _P),
        ("window", _I),
        ("act", _I),
        ("alpha", ctypes.c_double),
        ("limit", ctypes.c_double),
        ("sinks", _P),
        ("output_gate", _I),
        ("qkv", QLinearStruct),
        ("o", QLinearStruct),
        ("gate", QLinearStruct),
        ("up", QLinearStruct),
        ("down", QLinearStruct),
        ("experts", _I),
        ("top_k", _I),
        ("norm_topk", _I),
        ("router", _P),
        ("router_bias", _P),
        ("expert_products", ctypes.POINTER(QLinearStruct)),
        ("shared_gate", _P),
        ("mixer", MixerStruct),
        ("z", QLinearStruct),
        ("beta", QLinearStruct),
        ("dt", QLinearStruct),
        ("conv_state", _P),
        ("delta_state", _P),
    ]


class DecoderStruct(ctypes.Structure):
    """struct decoder: the model's shape, its layers and the cache's format."""

    _fields_ = [
        ("num_layers", _I),
        ("hidden", _I),
        ("heads", _I),
        ("kv_heads", _I),
        ("head_dim", _I),
        ("rotary_dim", _I),
        ("block_size", _I),
        ("kv_type", _I),
        ("q16", _I),
        ("eps", ctypes.c_double),
        ("scale", ctypes.c_double),
        ("layers", ctypes.POINTER(DecoderLayerStruct)),
    ]


# In the order kvserve_struct_sizes writes their sizes, with their C names.
STRUCTS: tuple[tuple[str, type[ctypes.Structure]], ...] = (
    ("qlinear", QLinearStruct),
    ("mixer", MixerStruct),
    ("decoder_layer", DecoderLayerStruct),
    ("decoder", DecoderStruct),
)

# attention_kernel: q, q_stride, out, k_cache, v_cache, tables, table_stride, lens, window, rows, heads,
# kv_heads, dim, block_size, scale, sinks, threads.
ATTENTION_ARGTYPES: list[Any] = [
    _P,
    _I,
    _P,
    _P,
    _P,
    _P,
    _I,
    _P,
    _I,
    _I,
    _I,
    _I,
    _I,
    _I,
    ctypes.c_double,
    _P,
    _C,
]

# The decoder layers' cache formats (KV_TYPE_* in kvserve.h), by the cache tensors' dtype (a uint8 cache
# holds q8_0 blocks, kvserve.model.kv_quant).
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.uint8: 2}

# (compute dtype, KV cache tensors' dtype) -> the attention kernel's symbol.
ATTENTION_SYMBOLS = {
    (torch.float32, torch.float32): "paged_attention_f32",
    (torch.float64, torch.float64): "paged_attention_f64",
    (torch.float32, torch.float16): "paged_attention_f32_kv16",
    (torch.float32, torch.uint8): "paged_attention_f32_q8",
    (torch.float64, torch.uint8): "paged_attention_f64_q8",
}


@dataclass(frozen=True)
class Function:
    """One exported function's ctypes signature."""

    restype: Any
    argtypes: Sequence[Any]
    # A compiler without _Float16 builds no float16 kernels: their callers check for the symbol.
    optional: bool = False


@dataclass(frozen=True)
class KernelLibrary:
    """One native library: its sources (paths under kernels/, every header there is included in its build
    key), its compile flags and the functions Python calls in it."""

    name: str
    sources: tuple[str, ...]
    compile_flags: tuple[str, ...]
    functions: dict[str, Function] = field(default_factory=dict)


_ABI_FUNCTIONS = {
    "kvserve_abi_version": Function(_C, []),
    "kvserve_struct_sizes": Function(_C, [ctypes.POINTER(_I), _C]),
}

# Every float operation as written: no -ffast-math, no contraction into fused multiply-adds the kernels
# did not ask for (the products' bits are their summation order).
LINEAR = KernelLibrary(
    "quant_linear",
    ("abi.c", "quants.c", "arch/x86/quants.c", "matmul.c", "decoder.c", "activation.c"),
    ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-std=c11"),
    {
        "quant_linear": Function(_C, [_P, _P, _P, _P, _I, _C, _C, _C, _C]),
        "quant_linear_vectorized": Function(_C, []),
        "dequantize_rows": Function(_C, [_C, _P, _I, _I, _P, _I, _P, _C]),
        "quant_type_supported": Function(_C, [_C]),
        "rms_norm_rows": Function(None, [_P, _P, _P, _I, _I, ctypes.c_float]),
        "gelu_tanh_rows": Function(None, [_P, _P, _I, _C, _C]),
        "silu_rows": Function(None, [_P, _P, _I, _C, _C]),
        "moe_route": Function(_C, [_P, _P, _P, _I, _I, _I, _I, _C, _P, _P]),
        "clamped_swiglu_rows": Function(None, [_P, _P, _I, ctypes.c_float, ctypes.c_float]),
        "gate_rows": Function(None, [_P, _P, _I]),
        "shared_expert_rows": Function(None, [_P, _P, _P, _P, _I, _I]),
        "mixer_rows": Function(_C, [_P, _P, _P, _P, _P, _P, _P, _I, _P, _P, _C]),
        "decoder_layers": Function(_C, [_P, _P, _I, _P, _P, _P, _I, _P, _P, _I, _P, _P, _P, _C]),
        "decoder_layers_kv16": Function(_C, []),
    },
)

# -ffast-math is given to the compile step only: linking with it would add a constructor that changes the
# whole process's denormal handling.
ATTENTION = KernelLibrary(
    "paged_attention",
    ("abi.c", "paged_attention.c"),
    ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"),
    {
        symbol: Function(_C, ATTENTION_ARGTYPES, optional=kv == torch.float16)
        for (_, kv), symbol in ATTENTION_SYMBOLS.items()
    },
)


def check_abi(lib: ctypes.CDLL, name: str) -> None:
    """Refuses (KernelAbiError) a library whose ABI version or struct sizes are not this module's."""
    mismatch = "kernels/kvserve.h and model/kernel_abi.py disagree"
    for symbol, fn in _ABI_FUNCTIONS.items():
        if not hasattr(lib, symbol):
            raise KernelAbiError(f"the {name} kernel library exports no {symbol}: {mismatch}")
        getattr(lib, symbol).restype = fn.restype
        getattr(lib, symbol).argtypes = fn.argtypes
    version = lib.kvserve_abi_version()
    if version != ABI_VERSION:
        raise KernelAbiError(
            f"the {name} kernel library has ABI version {version}, kvserve expects {ABI_VERSION}: {mismatch}"
        )
    sizes = (_I * len(STRUCTS))()
    count = lib.kvserve_struct_sizes(sizes, len(STRUCTS))
    if count != len(STRUCTS):
        raise KernelAbiError(
            f"the {name} kernel library declares {count} structs, kvserve {len(STRUCTS)}: {mismatch}"
        )
    for (c_name, struct), size in zip(STRUCTS, sizes, strict=True):
        if size != ctypes.sizeof(struct):
            raise KernelAbiError(
                f"the {name} kernel library's struct {c_name} is {size} bytes, kvserve's "
                f"{ctypes.sizeof(struct)}: {mismatch}"
            )


def bind(lib: ctypes.CDLL, library: KernelLibrary) -> None:
    """Checks the library's ABI (`check_abi`), then sets every function's ctypes signature."""
    check_abi(lib, library.name)
    for symbol, fn in library.functions.items():
        if not hasattr(lib, symbol):
            if fn.optional:
                continue
            raise KernelAbiError(f"the {library.name} kernel library exports no {symbol}")
        getattr(lib, symbol).restype = fn.restype
        getattr(lib, symbol).argtypes = fn.argtypes
