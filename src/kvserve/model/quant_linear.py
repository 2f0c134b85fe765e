"""Products on quantized weight blocks through the native kernel (kernels/matmul.c and the block code
beside it, kernels/quants.h).

One native call per product, the op that follows it (silu, add, mul) and the bias included. The kernel
sums every output in one fixed order, so a row's output is bitwise the same alone or in any batch, and
its AVX2 path and portable path give the same bits. The library's compile flags (kernel_abi.LINEAR) keep
the kernel's float operations exactly as written.
"""

import ctypes
import functools
import logging
from dataclasses import dataclass

import torch

from kvserve.model import huge_pages
from kvserve.model.kernel_abi import COL_TILE, LINEAR, OP_ADD, OP_MUL, OP_NONE, OP_SILU
from kvserve.model.linear import Linear, make_linear
from kvserve.model.native_build import KernelUnavailableError, load_kernel
from kvserve.model.quant_blocks import QK, QuantizedWeight, dequantize_rows, quantize_q8_0

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


class BlockArena:
    """Lays a model's products out side by side in large buffers on huge pages (`huge_pages.empty`), in
    the order they are built, so that a decode streams its weights from 2 MiB pages rather than from
    4 KiB pages scattered through the heap (docs/design.md, Forward pass, measures the gain). Memory that
    no product takes is never touched, so it costs no resident memory; a product larger than a chunk gets
    a buffer of its own."""

    CHUNK = 64 << 20
    # Each product starts on a cache line.
    ALIGN = 64

    def __init__(self) -> None:
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A fresh uint8 buffer of `nbytes`, a view into the current chunk where it fits."""
        span = -(-nbytes // self.ALIGN) * self.ALIGN
        if span > self.CHUNK:
            return huge_pages.empty((nbytes,), torch.uint8)
        if self._chunk is None or self._used + span > self.CHUNK:
            self._chunk = huge_pages.empty((self.CHUNK,), torch.uint8)
            self._used = 0
        view = self._chunk[self._used : self._used + nbytes]
        self._used += span
        return view


def interleave(weight: QuantizedWeight, arena: BlockArena | None = None) -> torch.Tensor:
    """The kernel's layout of the blocks (unchanged bytes, reordered): outputs in groups of COL_TILE with
    their blocks side by side (block b of each, then block b + 1), so that a decode, which computes a
    group's outputs together, reads one contiguous stream; the last outputs that fill no group as rows.
    Written into `arena` when one is given."""
    data = weight.data
    grouped = weight.out_features // COL_TILE * COL_TILE
    nb = weight.in_features // QK
    # Spelled out, not -1: a product of fewer than COL_TILE outputs has no group to infer it from.
    block = data.shape[1] // nb
    # Copied straight into one buffer: a temporary as large as the weight would stay in the heap.
    out = huge_pages.empty((data.numel(),), torch.uint8) if arena is None else arena.take(data.numel())
    head = data[:grouped].reshape(grouped // COL_TILE, COL_TILE, nb, block).transpose(1, 2)
    out[: head.numel()].view(grouped // COL_TILE, nb, COL_TILE, block).copy_(head)
    out[head.numel() :].copy_(data[grouped:].reshape(-1))
    return out


@dataclass(frozen=True)
class BlockShape:
    """What a product keeps of its loaded blocks once they are interleaved: their type and shape."""

    qtype: int
    in_features: int
    out_features: int


class QuantLinear(Linear):
    """y = op(x @ dequantize(weight).T + bias) on the weight's blocks, x float32 on the CPU.

    `int16_decodes`: the decode rows (`decodes`, see Linear) run with int16 activations, about twice as
    fast as widening every quant to float32 (kernels/quants.c says how, docs/design.md what it
    costs in accuracy); False computes every row in float32. `portable` forces the kernel's portable path
    (tests compare it with the vector path); `wide` False keeps a batch on the AVX2 tiles where the build
    also has AVX-512 ones (the same bits; for tests and benchmarks). `arena` holds the kernel's layout of
    the blocks where given (a model's products share one, see BlockArena).

    Only the interleaved copy is kept: the blocks as loaded are not referenced once it is made, so the
    model's weights are resident once (`weight` is their type and shape; `rows` reads the interleaved
    copy for a tied embedding's lookups).
    """

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None,
        cache_dir: str,
        int16_decodes: bool = False,
        portable: bool = False,
        wide: bool = True,
        arena: BlockArena | None = None,
    ) -> None:
        if weight.data.device.type != "cpu":
            raise KernelUnavailableError("quantized weights run on the CPU")
        self.lib = load_library(cache_dir)
        self.weight = BlockShape(weight.qtype, weight.in_features, weight.out_features)
        self._data = interleave(weight, arena)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        if self.bias is not None and self.bias.shape != (weight.out_features,):
            raise ValueError(f"bias of shape {tuple(self.bias.shape)} for {weight.out_features} outputs")
        self.int16_decodes = int16_decodes
        self.portable = portable
        self.wide = wide

    @property
    def data_ptr(self) -> int:
        """The address of the kernel's layout of the blocks."""
        return int(self._data.data_ptr())

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` of the weight dequantized to float32 [*index.shape, in], read from the
        interleaved copy: the same bytes as the loaded blocks' rows, so the same values bit for bit."""
        w = self.weight
        flat = index.reshape(-1)
        row_bytes = self._data.numel() // w.out_features
        grouped = w.out_features // COL_TILE * COL_TILE
        nb = w.in_features // QK
        block = row_bytes // nb
        head = self._data[: grouped * row_bytes].view(grouped // COL_TILE, nb, COL_TILE, block)
        tail = self._data[grouped * row_bytes :].view(-1, row_bytes)
        picked = torch.empty((flat.numel(), row_bytes), dtype=torch.uint8)
        in_head = flat < grouped
        h = flat[in_head]
        picked[in_head] = head[h // COL_TILE, :, h % COL_TILE].reshape(-1, row_bytes)
        picked[~in_head] = tail[flat[~in_head] - grouped]
        return dequantize_rows(picked, w.qtype, w.in_features).reshape(*index.shape, w.in_features)

    @property
    def vectorized(self) -> bool:
        """Whether the kernel was built with its AVX2 path."""
        return bool(self.lib.quant_linear_vectorized())

    def _run(self, x: torch.Tensor, op: int, other: torch.Tensor | None, decodes: int) -> torch.Tensor:
        n_in, n_out = self.weight.in_features, self.weight.out_features
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != n_in:
            raise ValueError(f"expected float32 CPU input [..., {n_in}], got {x.dtype} {tuple(x.shape)}")
        rows = x.reshape(-1, n_in).contiguous()
        out = torch.empty((rows.shape[0], n_out), dtype=torch.float32)
        if other is not None:
            other = other.reshape(rows.shape[0], n_out).float().contiguous()
        status = self.lib.quant_linear(
            self.weight.qtype,
            self._data.data_ptr(),
            rows.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(),
            None if other is None else other.data_ptr(),
            out.data_ptr(),
            rows.shape[0],
            n_in,
            n_out,
            op,
            torch.get_num_threads(),
            1 if self.portable else 0 if self.wide else 2,
            min(decodes, rows.shape[0]) if self.int16_decodes else 0,
        )
        if status == -2:
            raise MemoryError("the quantized linear kernel could not allocate its scratch memory")
        if status != 0:
            raise ValueError(
                f"the quantized linear kernel refused type {self.weight.qtype} with {n_in} inputs"
            )
        return out.view(*x.shape[:-1], n_out)

    def __call__(self, x: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        return self._run(x, OP_NONE, None, decodes)

    def silu(self, x: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        return self._run(x, OP_SILU, None, decodes)

    def gelu_tanh(self, x: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        """The product, then the native decoder's own gelu (`gelu_tanh_rows`), so that both paths'
        activation is one function."""
        out = self._run(x, OP_NONE, None, decodes)
        self.lib.gelu_tanh_rows(out.data_ptr(), out.data_ptr(), out.numel())
        return out

    def add(self, x: torch.Tensor, other: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        return self._run(x, OP_ADD, other, decodes)

    def mul(self, x: torch.Tensor, other: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        return self._run(x, OP_MUL, other, decodes)


def make_block_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    blocks: QuantizedWeight | None,
    weight_dtype: str,
    cache_dir: str,
    int16_decodes: bool = False,
    arena: BlockArena | None = None,
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
        return QuantLinear(blocks, bias, cache_dir, int16_decodes, arena=arena)
    except KernelUnavailableError as e:
        log.warning("quantized weights fall back to float16: %s", e)
        return make_linear(weight, bias, "float16")
