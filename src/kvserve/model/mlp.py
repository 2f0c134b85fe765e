"""A layer's feed-forward block behind one interface, which the dense gated MLPs here and a
mixture-of-experts block both implement."""

import ctypes
from abc import ABC, abstractmethod

import torch

from kvserve.model.linear import Linear


class Mlp(ABC):
    """The feed-forward block of one decoder layer, on the normed hidden rows x [tokens, hidden].

    `decodes`: the first `decodes` rows are one-token rows (see Linear); an implementation passes it to
    its products, so a row's output does not depend on its batch.

    `add` is the call the residual stream takes: it returns residual + mlp(x) and may write into a
    fresh tensor or ride the add on its last product (the dense block does). `__call__` returns mlp(x)
    alone, for layers that norm the block's output before the residual add (Gemma's post norms).
    Neither may change x or residual in place.
    """

    @abstractmethod
    def __call__(self, x: torch.Tensor, decodes: int = 0) -> torch.Tensor: ...

    @abstractmethod
    def add(self, x: torch.Tensor, residual: torch.Tensor, decodes: int = 0) -> torch.Tensor: ...


class GatedMlp(Mlp):
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with gelu_pytorch_tanh.

    With silu the activation rides on the gate's product and the gate's output multiplies into the up
    product as it is written; the residual add rides on down's product.
    """

    def __init__(self, gate: Linear, up: Linear, down: Linear, activation: str) -> None:
        if activation not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"activation {activation!r} is not supported")
        self.gate = gate
        self.up = up
        self.down = down
        self.activation = activation

    def _hidden(self, x: torch.Tensor, decodes: int) -> torch.Tensor:
        silu = self.activation == "silu"
        gated = self.gate.silu(x, decodes) if silu else self.gate.gelu_tanh(x, decodes)
        return self.up.mul(x, gated, decodes)

    def __call__(self, x: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        return self.down(self._hidden(x, decodes), decodes)

    def add(self, x: torch.Tensor, residual: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        return self.down.add(self._hidden(x, decodes), residual, decodes)


class ClampedSwiGlu(Mlp):
    """gpt-oss's expert: down((clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)) with
    g = min(gate, limit), every product with its bias. The clamps keep the activations of a model
    trained in low precision bounded; the +1 is part of the trained function, not an offset to drop.
    `native`: the kernel library whose `clamped_swiglu_rows` (the native decoder's own) computes the
    activation on float32 rows, where the products are native."""

    def __init__(
        self,
        gate: Linear,
        up: Linear,
        down: Linear,
        alpha: float,
        limit: float,
        native: ctypes.CDLL | None = None,
    ) -> None:
        self.gate = gate
        self.up = up
        self.down = down
        self.alpha = alpha
        self.limit = limit
        self.native = native

    def _hidden(self, x: torch.Tensor, decodes: int) -> torch.Tensor:
        if self.native is not None and x.dtype == torch.float32:
            gated, up = self.gate(x, decodes).contiguous(), self.up(x, decodes).contiguous()
            lib = self.native
            lib.clamped_swiglu_rows(gated.data_ptr(), up.data_ptr(), up.numel(), self.alpha, self.limit)
            return up
        gate = self.gate(x, decodes).clamp_(max=self.limit)
        up = self.up(x, decodes).clamp_(-self.limit, self.limit).add_(1.0)
        return up.mul_(gate * torch.sigmoid(gate * self.alpha))

    def __call__(self, x: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        return self.down(self._hidden(x, decodes), decodes)

    def add(self, x: torch.Tensor, residual: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        return self.down.add(self._hidden(x, decodes), residual, decodes)


# A mixture of experts' expert: both kinds have gate, up and down products.
Expert = GatedMlp | ClampedSwiGlu
