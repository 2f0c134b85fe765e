"""A mixture of experts with a shared expert beside the routed ones (Qwen3.5-MoE, Qwen2-MoE): every token
also runs the shared SwiGLU MLP, whose output is scaled by sigmoid(x . gate) and added to the routed
experts' sum.

The gate's logit of a row is summed over that row alone (`moe.router_logits`, as the router's), so a row's
output does not depend on its batch, as every product in kvserve keeps it. Where the routing is native, so
is the gate and the sum (`shared_expert_rows`, the native decoder's own function).
"""

import torch

from kvserve.model.mlp import GatedMlp, Mlp
from kvserve.model.moe import SparseMoe, router_logits


class SharedExpertMoe(Mlp):
    """`routed` (the sparse experts) plus `shared` scaled by sigmoid(x . `gate`), `gate` [hidden] in the
    compute dtype."""

    def __init__(self, routed: SparseMoe, shared: GatedMlp, gate: torch.Tensor) -> None:
        if gate.dim() != 1:
            raise ValueError(f"a shared expert's gate of shape {tuple(gate.shape)}: one weight per input")
        self.routed = routed
        self.shared = shared
        self.gate = gate.contiguous().view(1, -1)
        # The routing's kernel library where it routes natively (and so float32 rows on the CPU).
        self.native = routed.native if shared.activation == "silu" else None

    def __call__(self, x: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        if self.native is not None and x.dtype == torch.float32:
            x = x.contiguous()
            routed = self.routed(x, decodes).contiguous()
            shared = self.shared(x, decodes).contiguous()
            rows, hidden = x.shape
            self.native.shared_expert_rows(
                routed.data_ptr(), shared.data_ptr(), x.data_ptr(), self.gate.data_ptr(), rows, hidden
            )
            return routed
        scale = torch.sigmoid(router_logits(x, self.gate))
        return self.routed(x, decodes).addcmul_(self.shared(x, decodes), scale)

    def add(self, x: torch.Tensor, residual: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        """residual + moe(x)"""
        return self(x, decodes).add_(residual)
