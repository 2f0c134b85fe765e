"""Tiny random models of every supported family beyond Llama, as transformers builds them, and our
runner against transformers on them: the cases the family tests share."""

from typing import Any

import torch

from kvserve.model.loader import LoadedModel
from kvserve.model.runner import ForwardBatch, ModelRunner, SequenceChunk

# Phi-3's LongRoPE factors for a rotary dim of 8 (head_dim 16, partial_rotary_factor 0.5).
_LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.3, 1.7, 2.3],
    "long_factor": [1.5, 2.5, 4.0, 7.0],
}

# Each case: the family and the transformers config fields that make it. Every layer kind appears:
# q/k norms (qwen3, gemma3), NoPE layers (smollm3), fused products with partial rotary and LongRoPE
# (phi3), sliding layers with a local rope base beside global ones with linear scaling (gemma3).
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3", {"head_dim": 24, "tie_word_embeddings": False}),
    "qwen3-tied-bias": ("qwen3", {"attention_bias": True, "tie_word_embeddings": True}),
    "smollm3-nope": ("smollm3", {"num_hidden_layers": 4, "no_rope_layer_interval": 2}),
    "phi3-longrope": (
        "phi3",
        {
            "num_attention_heads": 4,
            "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 64,
            "rope_scaling": _LONGROPE,
            "tie_word_embeddings": False,
        },
    ),
    "gemma3": (
        "gemma3",
        {
            "num_hidden_layers": 4,
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            "rope_local_base_freq": 100.0,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        },
    ),
}


# LFM2's hybrid shape: gated short convolutions (recurrent state) around one attention layer.
LFM2_HYBRID: dict[str, Any] = {
    "num_hidden_layers": 3,
    "layer_types": ["conv", "full_attention", "conv"],
    "conv_L_cache": 3,
    "block_auto_adjust_ff_dim": False,
}

# Every family beyond Llama for the randomized differential test: the parity tests' cases
# (above), Gemma 3's window cut to 5 so that its sliding layers slide within the
# workloads' prompts, a Qwen3-MoE with a dense layer among the sparse ones, a gpt-oss, and two hybrids
# (LFM2, Qwen3.5).
# Gated DeltaNet layers around an attention layer, small heads (Qwen3.5 and Qwen3-Next alike).
DELTANET_HYBRID: dict[str, Any] = {
    "num_hidden_layers": 3,
    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}
FAMILY_KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    **{name: CASES[name] for name in ("qwen3", "smollm3-nope", "phi3-longrope")},
    "gemma3-window-5": (CASES["gemma3"][0], {**CASES["gemma3"][1], "sliding_window": 5}),
    "qwen3-moe": (
        "qwen3_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
        },
    ),
    "lfm2-hybrid": ("lfm2", LFM2_HYBRID),
    "qwen3_5-hybrid": ("qwen3_5", DELTANET_HYBRID),
    # Qwen3.5-MoE's layers with the DeltaNet's projections fused by key head, a dense last layer.
    "qwen3_next-hybrid": (
        "qwen3_next",
        {
            **DELTANET_HYBRID,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 24,
            "mlp_only_layers": [2],
        },
    ),
    # Sinks, a window of 5 on the even layers, biases and the clamped experts.
    "gpt-oss-window-5": (
        "gpt_oss",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 64,
            "head_dim": 16,
            "sliding_window": 5,
            "tie_word_embeddings": False,
        },
    ),
}


def exact_runner(model: LoadedModel, max_positions: int = 512, weight_dtype: str = "float32") -> ModelRunner:
    """float32 compute, float32 KV, blocks of 4 tokens: the setting that matches transformers."""
    return ModelRunner(model, 160, 4, max_positions, "cpu", "float32", weight_dtype, kv_dtype="float32")


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # type: ignore[no-any-return]


def batched_greedy(
    runner: ModelRunner, theirs: Any, prompts: list[list[int]], tables: list[list[int]], steps: int
) -> list[list[int]]:
    """Prefill the prompts together, then decode them together for `steps` steps, greedily; each step's
    logits must equal transformers' for that sequence. Returns the whole sequences."""
    seqs = [list(p) for p in prompts]
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    chunks = [SequenceChunk(p, 0, t, True) for p, t in zip(prompts, tables, strict=True)]
    logits = runner.execute(ForwardBatch(prefills=chunks)).sampled
    for _ in range(steps):
        for i, row in enumerate(logits):
            rows[i].append(row)
            seqs[i].append(int(row.argmax()))
        decodes = [SequenceChunk(s[-1:], len(s) - 1, t, True) for s, t in zip(seqs, tables, strict=True)]
        logits = runner.execute(ForwardBatch(decodes=decodes)).sampled
    for prompt, seq, got in zip(prompts, seqs, rows, strict=True):
        expected = hf_logits(theirs, seq[:-1])[len(prompt) - 1 :]
        torch.testing.assert_close(torch.stack(got), expected, atol=1e-4, rtol=1e-4)
    return seqs


def prompt_and_greedy(runner: ModelRunner, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """Logits at every prompt position, then `steps` greedy tokens (logits of each decode appended)."""
    table = list(range(-(-(len(prompt) + steps) // 4)))
    out = runner.execute(ForwardBatch(prefills=[SequenceChunk(prompt, 0, table, True, all_logits=True)]))
    rows = [out.chunks[0]]
    ids = list(prompt)
    logits = out.sampled[0]
    for _ in range(steps):
        ids.append(int(logits.argmax()))
        logits = runner.execute(
            ForwardBatch(decodes=[SequenceChunk(ids[-1:], len(ids) - 1, table, True)])
        ).sampled[0]
        rows.append(logits.unsqueeze(0))
    return torch.cat(rows), ids[len(prompt) :]


def random_prompt(n: int, seed: int, vocab: int = 49152) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def gguf_case(case: str) -> tuple[str, dict[str, Any]]:
    """A case as its GGUF can hold it: the tiny vocabulary of the GGUF tests, a down projection of 256
    inputs (a K-quant's super-block), for Gemma 3 a query_pre_attn_scalar of head_dim (llama.cpp keeps
    no such key and takes head_dim), for SmolLM3 a NoPE interval of 4 (llama.cpp's fixed one)."""
    from tests.model.gguf_families import tiny_vocabulary

    family, overrides = CASES[case]
    vocabulary = tiny_vocabulary(family)
    overrides = {
        **overrides,
        "intermediate_size": 256,
        "vocab_size": len(vocabulary),
        "bos_token_id": vocabulary.bos,
        "eos_token_id": vocabulary.eos,
        "pad_token_id": vocabulary.eos if vocabulary.pad is None else vocabulary.pad,
    }
    if family == "gemma3":
        overrides["query_pre_attn_scalar"] = overrides["head_dim"]
    if family == "smollm3":
        overrides["no_rope_layer_interval"] = 4
    return family, overrides
