"""The sparse mixture-of-experts MLP of Qwen3-MoE: a router picks `top_k` experts per token, and the
token's MLP output is the sum of those experts' SwiGLU outputs, each weighted by its routing probability.

A step groups its rows by expert: every (token, expert) pair is sorted by expert, each chosen expert
runs once on the rows that chose it, and an expert that no row chose is never read. That is what makes a
MoE decode cheap: a token reads top_k of the experts' bytes, not all of them.

Batch invariance, as every product in kvserve keeps it (docs/design.md, *Bitwise batch invariance*): a
row's output is bitwise the same alone or in any batch.
- The router's logits are each a float32 product and sum over the row alone (`router_logits`), not a
  GEMM, whose kernel, hence its last bits, changes with the batch; the routing choices must not flip
  with the batch. Ties between experts go to the lower expert id (a stable sort).
- An expert's products are the model's Linear products on the rows gathered for it; the native block
  products (and the float16 and int8 ones) give a row the same bits in any batch. The gathered rows keep
  their step order, so the step's decode rows stay in front and each expert is told how many it got.
- Where the experts' products are the native block products, the routing is native too (`moe_route` in
  kernels/decoder.c, the function the one-call decoder calls): both paths route with the same bits.
- A row's top_k outputs are added in the order of their rank (highest probability first), never in the
  order the experts happen to run in the step, and then added to the residual.
"""

import ctypes
from collections.abc import Sequence

import torch

from kvserve.model.mlp import Expert, Mlp

# Bytes of float32 products the router computes at once: bounds its scratch at any step size.
_ROUTER_CHUNK_BYTES = 4 << 20


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, hidden] @ weight [experts, hidden].T, each logit summed over its own row's products, so that
    it does not depend on the other rows (a matmul kernel's summation order does)."""
    rows, hidden = x.shape
    experts = weight.shape[0]
    out = torch.empty((rows, experts), dtype=x.dtype, device=x.device)
    chunk = max(1, _ROUTER_CHUNK_BYTES // (experts * hidden * x.element_size()))
    for start in range(0, rows, chunk):
        part = x[start : start + chunk]
        torch.sum(part.unsqueeze(1) * weight, dim=-1, out=out[start : start + part.shape[0]])
    return out


def route(
    x: torch.Tensor,
    weight: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's chosen experts [T, top_k] (int64, highest probability first) and their weights
    [T, top_k] in x's dtype: the softmax over every expert, in float32, of the chosen ones, renormalized
    to sum to 1 when `norm_topk_prob` (gpt-oss's softmax over the top-k logits is that, with its
    router's `bias` added to the logits)."""
    logits = router_logits(x, weight)
    if bias is not None:
        logits.add_(bias)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, chosen = torch.sort(probs, dim=-1, descending=True, stable=True)
    top, chosen = top[:, :top_k], chosen[:, :top_k]
    if norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return chosen, top.to(x.dtype)


def native_route(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    weight: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` through the native kernel (x, weight and bias float32 on the CPU): the same choices and
    order, the logits summed and the softmax taken in the kernel's own fixed order."""
    x = x.contiguous()
    rows, hidden = x.shape
    chosen = torch.empty((rows, top_k), dtype=torch.int64)
    weights = torch.empty((rows, top_k), dtype=torch.float32)
    status = lib.moe_route(
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        rows,
        hidden,
        weight.shape[0],
        top_k,
        int(norm_topk_prob),
        chosen.data_ptr(),
        weights.data_ptr(),
    )
    if status == -2:
        raise MemoryError("the native router could not allocate its scratch memory")
    if status != 0:
        raise ValueError(f"the native router refused top_k {top_k} of {weight.shape[0]} experts")
    return chosen, weights


class SparseMoe(Mlp):
    """The MoE MLP of one layer. `router` [experts, hidden] in the compute dtype (kept exact: routing
    choices are discrete, and llama.cpp keeps it unquantized too); `experts` (each a dense gated MLP) in
    expert id order. `native_router`: the kernel library whose `moe_route` routes float32 rows (where the
    experts' products are native), else None. `router_bias`: gpt-oss's bias of the router's logits (its
    experts are `ClampedSwiGlu`)."""

    def __init__(
        self,
        router: torch.Tensor,
        experts: Sequence[Expert],
        top_k: int,
        norm_topk_prob: bool,
        native_router: ctypes.CDLL | None = None,
        router_bias: torch.Tensor | None = None,
    ) -> None:
        if router.dim() != 2 or router.shape[0] != len(experts):
            raise ValueError(f"a router of shape {tuple(router.shape)} for {len(experts)} experts")
        if not 0 < top_k <= len(experts):
            raise ValueError(f"top_k {top_k} must be between 1 and the {len(experts)} experts")
        self.router = router.contiguous()
        self.experts = list(experts)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.router_bias = None if router_bias is None else router_bias.contiguous()
        self._lib = native_router

    @property
    def native(self) -> ctypes.CDLL | None:
        """The kernel library that routes float32 rows natively, or None."""
        return self._lib

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's chosen experts and their weights (`route`, or `native_route`)."""
        if self._lib is not None and x.dtype == torch.float32:
            return native_route(self._lib, x, self.router, self.top_k, self.norm_topk_prob, self.router_bias)
        return route(x, self.router, self.top_k, self.norm_topk_prob, self.router_bias)

    def __call__(self, x: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        """The MLP output [T, hidden] of x [T, hidden], whose first `decodes` rows are one-token rows."""
        rows, hidden = x.shape
        k = self.top_k
        chosen, weights = self.route(x)
        if rows == 1:
            return self._one_row(x, chosen, weights, decodes)
        # Pair p = token * k + rank. A stable sort by expert keeps each expert's pairs in token order, so
        # the decode rows (tokens below `decodes`) come first in every expert's group.
        flat = chosen.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        decode_counts = torch.bincount(flat[: decodes * k], minlength=len(self.experts)).tolist()
        gathered = x.index_select(0, order // k)
        scaled = torch.empty((rows * k, hidden), dtype=x.dtype, device=x.device)
        start = 0
        for expert, count, expert_decodes in zip(self.experts, counts, decode_counts, strict=True):
            if count:
                end = start + count
                out = expert(gathered[start:end], expert_decodes)
                scaled[start:end] = out.mul_(weights.reshape(-1, 1)[order[start:end]])
                start = end
        # Back to pair order, then each row's experts summed by rank.
        by_pair = torch.empty_like(scaled).index_copy_(0, order, scaled).view(rows, k, hidden)
        total = by_pair[:, 0].clone()
        for rank in range(1, k):
            total.add_(by_pair[:, rank])
        return total

    def _one_row(
        self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, decodes: int
    ) -> torch.Tensor:
        """A lone row (a step of one decode) without the grouping's dozen ops; the same operations on
        its row as in a batch, so the same bits."""
        total: torch.Tensor | None = None
        for rank, e in enumerate(chosen[0].tolist()):
            out = self.experts[e](x, decodes).mul_(weights[:, rank : rank + 1])
            total = out if total is None else total.add_(out)
        assert total is not None
        return total

    def add(self, x: torch.Tensor, residual: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        """residual + moe(x)"""
        return self(x, decodes).add_(residual)
