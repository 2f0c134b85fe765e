"""Products on the GGUF file's weight rows, read in place by the native kernel (kernels/matmul.c and the
code beside it, kernels/quants.h).

One native call per product, the op that follows it (add, mul) and the bias included; silu and gelu run
after it (`silu_rows`, `gelu_tanh_rows`). The kernel sums every output in one fixed order, so a row's
output is bitwise the same alone or in any batch, and its AVX2 path and portable path give the same bits.
The library's compile flags (kernel_abi.LINEAR) keep the kernel's float operations exactly as written.
"""

import ctypes
import functools
import logging

import torch

from kvserve.model.kernel_abi import (
    LINEAR,
    OP_ADD,
    OP_MUL,
    OP_NONE,
    QLINEAR_PARTS,
    QLinearStruct,
    QPartStruct,
)
from kvserve.model.linear import Linear, make_linear
from kvserve.model.native_build import KernelUnavailableError, load_kernel
from kvserve.model.quant_blocks import Blocks, quantize_q8_0, type_name

log = logging.getLogger(__name__)


@functools.cache
def load_library(cache_dir: str) -> ctypes.CDLL:
    """The products' and decoder layers' library (kernel_abi.LINEAR), built on first use."""
    return load_kernel(LINEAR, cache_dir)


class NativeRmsNorm:
    """rms_norm in one native call (torch's is five ops on the CPU, a fifth of a decode step's ops)."""

    def __init__(self, cache_dir: str) -> None:
        self.lib = load_library(cache_dir)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        assert x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.is_contiguous()
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty_like(rows)
        self.lib.rms_norm_rows(
            rows.data_ptr(), weight.data_ptr(), out.data_ptr(), rows.shape[0], rows.shape[1], eps
        )
        return out.view(x.shape)


class QuantLinear(Linear):
    """y = op(x @ dequantize(weight).T + bias) on the weight's rows in place, x float32 on the CPU.

    `weight` is one matrix or several parts of any types over the same inputs (QuantizedParts: q, k and v
    of different types), run in one native call with their outputs side by side. The product keeps a
    reference to the caller's tensors and reads them where they are (never writing them: they may be the
    file's mapping). `int16`: every row runs with int16 activations, faster than widening every quant to
    float32 (kernels/quants.c says how, docs/benchmarks.md what it costs in accuracy); False computes every
    row in float32 (the exact mode). Either way a row's bits depend neither on its batch nor on whether it
    is a decode (`decodes` is ignored). `portable` forces the kernel's portable
    path (tests compare it with the vector path); `wide` False keeps a batch on the AVX2 tiles where the
    build also has AVX-512 ones (the same bits; for tests and benchmarks).
    """

    def __init__(
        self,
        weight: Blocks,
        bias: torch.Tensor | None,
        cache_dir: str,
        int16: bool = False,
        portable: bool = False,
        wide: bool = True,
    ) -> None:
        if any(p.data.device.type != "cpu" for p in weight.parts):
            raise KernelUnavailableError("quantized weights run on the CPU")
        if len(weight.parts) > QLINEAR_PARTS:
            raise ValueError(f"a product holds at most {QLINEAR_PARTS} parts, not {len(weight.parts)}")
        self.lib = load_library(cache_dir)
        for p in weight.parts:
            if not self.lib.quant_type_supported(p.qtype):
                raise ValueError(f"weights of type {type_name(p.qtype)} are not read by this kernel build")
        self.weight = weight
        self.bias = None if bias is None else bias.detach().float().contiguous()
        if self.bias is not None and self.bias.shape != (weight.out_features,):
            raise ValueError(f"bias of shape {tuple(self.bias.shape)} for {weight.out_features} outputs")
        self.int16 = int16
        self.portable = portable
        self.wide = wide
        self.struct = self._struct()

    def _struct(self) -> QLinearStruct:
        """The kernel's description of the product: each part's type, rows and bias in place."""
        s = QLinearStruct(len(self.weight.parts), self.weight.in_features, self.weight.out_features)
        column = 0
        for i, p in enumerate(self.weight.parts):
            bias = None if self.bias is None else self.bias.data_ptr() + 4 * column
            s.parts[i] = QPartStruct(p.qtype, p.data.data_ptr(), bias, p.out_features)
            column += p.out_features
        return s

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of the weight dequantized to float32 [*index.shape, in] by the kernel (bit for
        bit the gguf package's values): the embedding lookup of a tied head."""
        flat = index.reshape(-1).to(torch.int64).contiguous()
        n_in = self.weight.in_features
        out = torch.empty((flat.numel(), n_in), dtype=torch.float32)
        start = 0
        for p in self.weight.parts:
            mine = (flat >= start) & (flat < start + p.out_features)
            local = (flat[mine] - start).contiguous() if len(self.weight.parts) > 1 else flat
            part_out = out if len(self.weight.parts) == 1 else torch.empty((local.numel(), n_in))
            status = self.lib.dequantize_rows(
                p.qtype,
                p.data.data_ptr(),
                p.out_features,
                n_in,
                local.data_ptr(),
                local.numel(),
                part_out.data_ptr(),
                torch.get_num_threads(),
            )
            if status != 0:
                raise IndexError(f"row index out of range for {self.weight.out_features} rows")
            if len(self.weight.parts) > 1:
                out[mine] = part_out
            start += p.out_features
        return out.reshape(*index.shape, n_in)

    @property
    def vectorized(self) -> bool:
        """Whether the kernel was built with its AVX2 path."""
        return bool(self.lib.quant_linear_vectorized())

    def _run(self, x: torch.Tensor, op: int, other: torch.Tensor | None) -> torch.Tensor:
        n_in, n_out = self.weight.in_features, self.weight.out_features
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != n_in:
            raise ValueError(f"expected float32 CPU input [..., {n_in}], got {x.dtype} {tuple(x.shape)}")
        rows = x.reshape(-1, n_in).contiguous()
        out = torch.empty((rows.shape[0], n_out), dtype=torch.float32)
        if other is not None:
            other = other.reshape(rows.shape[0], n_out).float().contiguous()
        status = self.lib.quant_linear(
            ctypes.byref(self.struct),
            rows.data_ptr(),
            None if other is None else other.data_ptr(),
            out.data_ptr(),
            rows.shape[0],
            op,
            torch.get_num_threads(),
            self._path(),
            1 if self.int16 else 0,
        )
        if status == -2:
            raise MemoryError("the quantized linear kernel could not allocate its scratch memory")
        if status != 0:
            types = ", ".join(type_name(p.qtype) for p in self.weight.parts)
            raise ValueError(f"the quantized linear kernel refused {types} with {n_in} inputs")
        return out.view(*x.shape[:-1], n_out)

    def __call__(self, x: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        return self._run(x, OP_NONE, None)

    def silu(self, x: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        """The product, then the native decoder's own silu (`silu_rows`, vectorized), so that both paths'
        activation is one function."""
        out = self._run(x, OP_NONE, None)
        self.lib.silu_rows(out.data_ptr(), out.data_ptr(), out.numel(), torch.get_num_threads(), self._path())
        return out

    def gelu_tanh(self, x: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        """The product, then the native decoder's own gelu (`gelu_tanh_rows`), as `silu`."""
        out = self._run(x, OP_NONE, None)
        self.lib.gelu_tanh_rows(
            out.data_ptr(), out.data_ptr(), out.numel(), torch.get_num_threads(), self._path()
        )
        return out

    def add(self, x: torch.Tensor, other: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        return self._run(x, OP_ADD, other)

    def mul(self, x: torch.Tensor, other: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        return self._run(x, OP_MUL, other)

    def _path(self) -> int:
        """The kernels' `portable` argument: 1 the portable path, 2 AVX2 without AVX-512, 0 the widest."""
        return 1 if self.portable else 0 if self.wide else 2


def make_block_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    blocks: Blocks | None,
    weight_dtype: str,
    cache_dir: str,
    int16: bool = False,
) -> Linear:
    """The Linear of a block mode: "gguf" (the file's own `blocks`) or "q8_0" (`weight` quantized now).

    `weight` is the float weight in the compute dtype ([out, in], the blocks dequantized for a GGUF).
    Without blocks of a type the kernel reads, "gguf" is "float16". Off the CPU or in another compute
    dtype than float32, the blocks' float values run through `F.linear`: the same model, without the
    kernel's speed. When the kernel cannot be built here, float16.
    """
    if weight_dtype == "q8_0":
        blocks = quantize_q8_0(weight)
    elif weight_dtype != "gguf":
        raise ValueError(f"not a block weight mode: {weight_dtype!r}")
    if blocks is None:
        return make_linear(weight, bias, "float16")
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return make_linear(blocks.dequantize().to(weight.device, weight.dtype), bias, "float32")
    try:
        return QuantLinear(blocks, bias, cache_dir, int16)
    except KernelUnavailableError as e:
        log.warning("quantized weights fall back to float16: %s", e)
        return make_linear(weight, bias, "float16")
