"""A layer's feed-forward block behind one interface, which the dense gated MLPs here and a
mixture-of-experts block both implement."""

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
