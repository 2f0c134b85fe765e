"""Linear layers, with the elementwise op that follows them fused in where the device has a kernel for it.

On the CPU in float32 the products run through oneDNN's inner-product primitive (the one torch's own
compiler emits for CPU linears), which can also apply silu, or add/multiply a second tensor, as it writes
the output. Measured on this project's 2-core x86 machines, over the 121 products of one step of the
default model, it is 1.8x faster than `F.linear` for a single-token decode, 1.9x at 8 rows, 1.5x at 32
and 1.1x at 512, besides saving the separate elementwise passes. Elsewhere it is `F.linear` plus the op.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _onednn_available() -> bool:
    is_available: Callable[[], bool] = torch.backends.mkldnn.is_available
    return is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _pointwise(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, attr: str) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, w, b, attr, [], "")
    return out


def _binary(
    x: torch.Tensor, other: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, op: str
) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(x, other, w, b, op)
    return out


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """`weight` in the [out, in] layout of checkpoints."""
        self.weight = weight.contiguous()
        self.bias = bias
        self._fused = weight.device.type == "cpu" and weight.dtype == torch.float32 and _onednn_available()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused:
            return _pointwise(x, self.weight, self.bias, "none")
        return F.linear(x, self.weight, self.bias)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(linear(x))"""
        if self._fused:
            return _pointwise(x, self.weight, self.bias, "swish")
        return F.silu(F.linear(x, self.weight, self.bias))

    def add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """linear(x) + other"""
        if self._fused:
            return _binary(x, other, self.weight, self.bias, "add")
        return F.linear(x, self.weight, self.bias) + other

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """linear(x) * other"""
        if self._fused:
            return _binary(x, other, self.weight, self.bias, "mul")
        return F.linear(x, self.weight, self.bias) * other
