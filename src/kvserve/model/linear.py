"""Linear layers in one of three weight precisions, each with the elementwise op that follows it.

Decode reads every weight once per step, so bytes per weight set its speed. `make_linear` builds:
- `float32`: weights in the compute dtype. On the CPU in float32 the products run through oneDNN's
  inner-product primitive (the one torch's own compiler emits for CPU linears), which can also apply silu,
  or add/multiply a second tensor, as it writes the output; it beats `F.linear` most for few rows
  (docs/benchmarks.md has the figures). Elsewhere it is `F.linear` plus the op.
  Neither is row-invariant: a one-row product takes another kernel than a batch, so a row's last bits
  depend on the batch size.
- `float16`: fbgemm's fp16 GEMM. Weights are stored in float16 and widened to float32 in registers;
  activations and accumulation stay float32. Half the bytes of float32. With AVX-512 each output element
  is summed in the same order whatever the number of rows; the AVX2 kernels sum a row in another order
  when it falls in a block of one or two rows, so there the rows are padded to a multiple of three
  (`_fp16_row_multiple`, probed once), which keeps every row in a three-row block or larger.
- `int8`: symmetric int8 weights with one scale per output channel, activations quantized per row with
  one scale per row, an exact int8 x int8 -> int32 product (`torch._int_mm`), then the two scales. Every
  step is exact or row-local, so a row's output does not depend on the batch either. A quarter of
  float32's bytes, but about ten small ops per product, and the least exact: a few large channels of the
  hidden state set each row's scale and leave the rest of the row few levels (docs/benchmarks.md, Precision).
  fbgemm's own int8 linear is not used: it quantizes activations with one scale per tensor, so a row's
  output would depend on its batch.

The low-precision modes apply silu, add or mul after the product (fbgemm and `_int_mm` fuse none).
"""

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import torch.nn.functional as F


def _onednn_available() -> bool:
    is_available: Callable[[], bool] = torch.backends.mkldnn.is_available
    return is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


@functools.cache
def _fp16_row_multiple() -> int:
    """The multiple of rows that fbgemm's float16 product must be called with for a row's output to be
    the same in any batch on this CPU: the first of 1, 3, 6 and 12 under which every batch of 1 to 32
    rows gives each row the bits it has in a batch of 48 (a small probe, once per process)."""
    gen = torch.Generator().manual_seed(0)
    packed = torch.ops.quantized.linear_prepack_fp16(torch.randn(64, 96, generator=gen), None)
    x = torch.randn(48, 96, generator=gen)
    for multiple in (1, 3, 6):
        full = _fp16_product(x, packed, multiple)
        if all(torch.equal(_fp16_product(x[:m], packed, multiple), full[:m]) for m in range(1, 33)):
            return multiple
    return 12


def _fp16_product(x: torch.Tensor, packed: object, multiple: int) -> torch.Tensor:
    rows = x.shape[0]
    pad = -rows % multiple
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    out: torch.Tensor = torch.ops.quantized.linear_dynamic_fp16(x, packed)
    return out[:rows] if pad else out


def _pointwise(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, attr: str) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, w, b, attr, [], "")
    return out


def _binary(
    x: torch.Tensor, other: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, op: str
) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(x, other, w, b, op)
    return out


class Linear(ABC):
    """y = x @ weight.T + bias, plus the op that follows it in the model.

    `decodes`: the first `decodes` rows of x are one-token rows (decodes, or rows whose logits are taken).
    Every Linear computes them as it computes any other row (the native blocks' int16 activations take
    every row), so a row's output depends neither on its batch nor on whether it is a decode.
    """

    @abstractmethod
    def __call__(self, x: torch.Tensor, decodes: int = 0) -> torch.Tensor: ...

    def silu(self, x: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        """silu(linear(x))"""
        return F.silu(self(x, decodes), inplace=True)

    def gelu_tanh(self, x: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        """gelu(linear(x)) with the tanh approximation"""
        return F.gelu(self(x, decodes), approximate="tanh")

    def add(self, x: torch.Tensor, other: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        """linear(x) + other"""
        return self(x, decodes).add_(other)

    def mul(self, x: torch.Tensor, other: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        """linear(x) * other"""
        return self(x, decodes).mul_(other)


class Float32Linear(Linear):
    """Weights in the compute dtype (float32 unless the engine's `dtype` says otherwise)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """`weight` in the [out, in] layout of checkpoints."""
        self.weight = weight.contiguous()
        # The fused kernel reads the bias as one dense row.
        self.bias = None if bias is None else bias.contiguous()
        self._fused = weight.device.type == "cpu" and weight.dtype == torch.float32 and _onednn_available()

    def __call__(self, x: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        if self._fused:
            return _pointwise(x, self.weight, self.bias, "none")
        return F.linear(x, self.weight, self.bias)

    def silu(self, x: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        if self._fused:
            return _pointwise(x, self.weight, self.bias, "swish")
        return super().silu(x)

    def add(self, x: torch.Tensor, other: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        if self._fused:
            return _binary(x, other, self.weight, self.bias, "add")
        return super().add(x, other)

    def mul(self, x: torch.Tensor, other: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        if self._fused:
            return _binary(x, other, self.weight, self.bias, "mul")
        return super().mul(x, other)


class Fp16Linear(Linear):
    """float16 weights, float32 activations and accumulation (fbgemm, CPU only).

    Weights beyond float16's range saturate at +-65504 (fbgemm warns); checkpoint weights are far inside it.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        # Packing once at load: it converts to float16 and lays the weights out in fbgemm's blocks.
        self._packed: object = torch.ops.quantized.linear_prepack_fp16(weight, bias)
        self._row_multiple = _fp16_row_multiple()

    def __call__(self, x: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        return _fp16_product(x, self._packed, self._row_multiple)


# 127, not 128: a symmetric range keeps -x quantized as the exact negative of x.
_INT8_MAX = 127.0
# Floor of a scale: an all-zero row or channel quantizes to zeros instead of dividing by zero.
_MIN_SCALE = torch.finfo(torch.float32).tiny


def _symmetric_int8(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and float32 scales along `dim` (keepdim), so that x ~ values * scales.

    No clamp before the cast: |x| <= amax, so |x / (amax / 127)| rounds to 127 at most.
    """
    scale = x.abs().amax(dim=dim, keepdim=True).div_(_INT8_MAX).clamp_(min=_MIN_SCALE)
    return torch.div(x, scale).round_().to(torch.int8), scale


@functools.cache
def _int_mm_is_exact() -> bool:
    """Whether this CPU's int8 kernel sums full-range products without saturating.

    x86 kernels without VNNI can add pairs of u8 x s8 products into int16 with saturation, which would
    corrupt large products silently; checked once on the extreme values, at a decode and a batch shape.
    """
    for rows in (1, 32):
        a = torch.full((rows, 64), 127, dtype=torch.int8)
        a[:, 1::2] = -127
        w = torch.full((48, 64), 127, dtype=torch.int8)
        w[::2, 1::2] = -127
        if not torch.equal(torch._int_mm(a, w.t()).long(), a.long() @ w.long().t()):
            return False
    return True


class Int8Linear(Linear):
    """Per-output-channel int8 weights, per-row int8 activations, an exact integer product (CPU only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        if not _int_mm_is_exact():
            raise ValueError(
                "weight_dtype='int8': torch._int_mm saturates on this CPU; use weight_dtype 'float16'"
            )
        values, scale = _symmetric_int8(weight.float(), dim=1)
        # `_int_mm` takes [in, out]; the transposed view of the [out, in] rows measured faster for
        # one-row decodes than a contiguous [in, out] copy, and as fast for batches.
        self._weight_t = values.t()
        self._channel_scale = scale.view(-1)
        self._bias = bias
        self._in_features = weight.shape[1]

    def __call__(self, x: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        rows = x.reshape(-1, self._in_features)
        # Per row, not per tensor: a row's scale, hence its output, must not depend on its batch.
        values, row_scale = _symmetric_int8(rows, dim=1)
        # The CPU kernel takes any shape, one row included (on CUDA it needs more than 16 rows).
        out = torch._int_mm(values, self._weight_t).float().mul_(row_scale).mul_(self._channel_scale)
        if self._bias is not None:
            out.add_(self._bias)
        return out.view(*x.shape[:-1], out.shape[-1])


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, weight_dtype: str) -> Linear:
    """The Linear for `weight` ([out, in], already on its device in the compute dtype) in `weight_dtype`.

    float16 and int8 are CPU kernels that take float32 activations. Elsewhere float16 falls back to the
    compute dtype's `F.linear` on the weights rounded to float16 (the same weight values as the CPU kernel,
    so the same model, without its speed), and int8 is refused.
    """
    cpu_float32 = weight.device.type == "cpu" and weight.dtype == torch.float32
    if weight_dtype == "float32":
        return Float32Linear(weight, bias)
    if weight_dtype == "float16":
        if cpu_float32 and _fbgemm_available():
            return Fp16Linear(weight, bias)
        return Float32Linear(weight.to(torch.float16).to(weight.dtype), bias)
    if weight_dtype == "int8":
        if not cpu_float32:
            raise ValueError(
                f"weight_dtype='int8' runs on the CPU with dtype float32, not on {weight.device.type} "
                f"with {weight.dtype}; use weight_dtype 'float32' or 'float16'"
            )
        return Int8Linear(weight, bias)
    raise ValueError(f"weight_dtype must be float32, float16 or int8, not {weight_dtype!r}")
