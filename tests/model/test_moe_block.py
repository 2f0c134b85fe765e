"""The sparse MoE MLP (kvserve.model.moe) against transformers' Qwen3MoeSparseMoeBlock, on tiny random
float32 weights with the experts unevenly used: the router is biased so that one expert takes most
tokens and the last one none. Quantized experts are compared with transformers' block on their
dequantized weights; a row's output is the same bits alone or in any batch; an expert no row chose is
never read.
"""

from typing import Any

import pytest
import torch

from kvserve.config import default_cache_dir
from kvserve.model.linear import Float32Linear, Linear
from kvserve.model.mlp import GatedMlp
from kvserve.model.moe import SparseMoe, route
from kvserve.model.quant_blocks import quantize_q8_0
from kvserve.model.quant_linear import QuantLinear

HIDDEN = 64
EXPERT_SIZE = 96
EXPERTS = 6
TOP_K = 2
TOKENS = 40


def reference_block(norm_topk_prob: bool) -> Any:
    """transformers' block with random weights; the router leans towards expert 0 and away from the last."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=EXPERT_SIZE,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=norm_topk_prob,
    )
    block = Qwen3MoeSparseMoeBlock(config).float().eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        block.experts.gate_up_proj.copy_(torch.randn(block.experts.gate_up_proj.shape, generator=gen) * 0.1)
        block.experts.down_proj.copy_(torch.randn(block.experts.down_proj.shape, generator=gen) * 0.1)
        lean = torch.tensor([3.0, 1.0, 0.5, 0.0, -0.5, -20.0]).unsqueeze(1) * direction()
        block.gate.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=gen) * 0.1 + lean)
    return block


def direction() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    u = torch.randn(HIDDEN, generator=gen)
    unit: torch.Tensor = u / u.norm()
    return unit


def hidden_states(n: int = TOKENS, seed: int = 1) -> torch.Tensor:
    """Rows that share a component along `direction` (as hidden states share their large channels), at
    scales from 0.1 to 10."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, HIDDEN, generator=gen) + 4 * direction()
    return x * torch.logspace(-1, 1, n).unsqueeze(1)


def expert_weights(block: Any, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gate, up = block.experts.gate_up_proj[e].detach().chunk(2, dim=0)
    return gate.contiguous(), up.contiguous(), block.experts.down_proj[e].detach().contiguous()


def ours(block: Any, make: Any, norm_topk_prob: bool) -> SparseMoe:
    experts = []
    for e in range(EXPERTS):
        gate, up, down = (make(w) for w in expert_weights(block, e))
        experts.append(GatedMlp(gate, up, down, "silu"))
    return SparseMoe(block.gate.weight.detach().clone(), experts, TOP_K, norm_topk_prob)


def q8_0_linear(w: torch.Tensor, int16: bool = False) -> Linear:
    return QuantLinear(quantize_q8_0(w), None, default_cache_dir(), int16=int16)


def dequantized(block: Any) -> Any:
    """`block` with its experts' weights replaced by their Q8_0 values."""
    copy = reference_block(block.gate.norm_topk_prob)
    with torch.no_grad():
        for e in range(EXPERTS):
            gate, up, down = (quantize_q8_0(w).dequantize() for w in expert_weights(block, e))
            copy.experts.gate_up_proj[e].copy_(torch.cat([gate, up]))
            copy.experts.down_proj[e].copy_(down)
    return copy


def test_the_router_uses_the_experts_unevenly() -> None:
    block = reference_block(True)
    chosen, _ = route(hidden_states(), block.gate.weight.detach(), TOP_K, True)
    counts = torch.bincount(chosen.reshape(-1), minlength=EXPERTS)
    assert counts[0] >= TOKENS * 3 // 4 and counts[-1] == 0 and (counts > 0).sum() >= 4, counts


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_float_experts_match_transformers(norm_topk_prob: bool) -> None:
    block = reference_block(norm_topk_prob)
    x = hidden_states()
    with torch.no_grad():
        expected = block(x.unsqueeze(0)).squeeze(0)
    actual = ours(block, Float32Linear, norm_topk_prob)(x)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_quantized_experts_match_transformers_on_their_dequantized_weights(norm_topk_prob: bool) -> None:
    block = reference_block(norm_topk_prob)
    x = hidden_states()
    with torch.no_grad():
        expected = dequantized(block)(x.unsqueeze(0)).squeeze(0)
    actual = ours(block, q8_0_linear, norm_topk_prob)(x)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def test_add_is_the_residual_plus_the_moe_output() -> None:
    block = reference_block(True)
    moe = ours(block, q8_0_linear, True)
    x, residual = hidden_states(), hidden_states(seed=2)
    assert torch.equal(moe.add(x, residual, 3), residual + moe(x, 3))


@pytest.mark.parametrize("int16", [False, True])
def test_a_rows_output_is_the_same_bits_alone_or_in_any_batch(int16: bool) -> None:
    moe = ours(reference_block(True), lambda w: q8_0_linear(w, int16), True)
    x = hidden_states()
    decodes = 7
    full = moe(x, decodes)
    for i in range(TOKENS):
        alone = moe(x[i : i + 1], 1 if i < decodes else 0)
        assert torch.equal(alone, full[i : i + 1]), i
    # Other batches: the decode rows in another order, and prefill rows without the decodes.
    shuffled = torch.cat(
        [torch.randperm(decodes, generator=torch.Generator().manual_seed(3)), torch.arange(30, 9, -1)]
    )
    assert torch.equal(moe(x[shuffled], decodes), full[shuffled])
    assert torch.equal(moe(x[decodes:], 0), full[decodes:])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(moe(x, decodes), full)
    finally:
        torch.set_num_threads(threads)


def test_decode_rows_and_prefill_rows_take_the_same_int16_products() -> None:
    block = reference_block(True)
    moe = ours(block, lambda w: q8_0_linear(w, True), True)
    as_float = ours(block, q8_0_linear, True)
    x = hidden_states()
    mixed = moe(x, 9)
    assert torch.equal(mixed, moe(x, 0)) and torch.equal(mixed, moe(x, x.shape[0]))
    assert not torch.equal(mixed, as_float(x, 9))


class Unread(Linear):
    """A product that must not run."""

    def __call__(self, x: torch.Tensor, decodes: int = 0) -> torch.Tensor:
        raise AssertionError("an expert that no row chose was read")


def test_an_expert_that_no_row_chose_is_never_read() -> None:
    block = reference_block(True)
    moe = ours(block, Float32Linear, True)
    moe.experts[-1] = GatedMlp(Unread(), Unread(), Unread(), "silu")
    x = hidden_states()
    with torch.no_grad():
        expected = block(x.unsqueeze(0)).squeeze(0)
    torch.testing.assert_close(moe(x), expected, rtol=1e-5, atol=1e-5)


def test_a_router_that_does_not_match_the_experts_is_refused() -> None:
    product = Float32Linear(torch.zeros(8, 32))
    expert = GatedMlp(product, product, product, "silu")
    with pytest.raises(ValueError, match="router of shape \\(3, 32\\) for 2 experts"):
        SparseMoe(torch.zeros(3, 32), [expert, expert], 1, True)
    with pytest.raises(ValueError, match="top_k 3"):
        SparseMoe(torch.zeros(2, 32), [expert, expert], 3, True)
