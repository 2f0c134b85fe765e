"""Time per token of one decode stream with the one-call native decoder against the per-op path, on
random models that transformers builds, hidden 640 and 18 layers: Gemma 3 (4 query heads and 1 KV head
of 256, its sliding layers, GeGLU, post norms), Qwen3 (8 query and 2 KV heads of 128, q/k norms) and a
Qwen3-MoE of Qwen3's attention with 8 experts of 512, top-2. Q8_0 blocks made at load
(`weight_dtype="q8_0"`), a float16 KV cache. The runner is driven directly: a 32-token prompt, then
`--tokens` greedy decodes; the two paths alternate run by run in one process (the per-op path by
detaching the decoder), so a shared machine's load hits both alike. Reported: the median run's ms per
token and the best run's.

Run: `make bench-family-decoder` (writes benchmarks/results/family_decoder.{json,md}).
"""

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from benchmarks.common import setup_threads, write_results
from kvserve.config import default_cache_dir
from kvserve.model.loader import load_model
from kvserve.model.runner import ForwardBatch, ModelRunner, SequenceChunk

COMMON: dict[str, Any] = {
    "vocab_size": 4096,
    "hidden_size": 640,
    "num_hidden_layers": 18,
    "intermediate_size": 2048,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
SHAPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512},
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128, "tie_word_embeddings": True},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "tie_word_embeddings": True,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 512,
            "norm_topk_prob": True,
        },
    ),
}
PROMPT = 32
BLOCK = 16


def save_model(path: str, family: str) -> str:
    import transformers

    config_name, model_name, shape = SHAPES[family]
    config = getattr(transformers, config_name)(**COMMON, **shape)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.save_pretrained(path, safe_serialization=True)
    return path


def ms_per_token(runner: ModelRunner, tokens: int, seed: int) -> float:
    """Mean ms per decode step of one stream after a fresh prompt."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 4000, (PROMPT,), generator=gen).tolist()
    table = list(range(-(-(PROMPT + tokens) // BLOCK)))
    logits = runner.execute(ForwardBatch(prefills=[SequenceChunk(ids, 0, table, True)])).sampled
    start = time.perf_counter()
    for _ in range(tokens):
        ids.append(int(logits[0].argmax()))
        step = ForwardBatch(decodes=[SequenceChunk(ids[-1:], len(ids) - 1, table, True)])
        logits = runner.execute(step).sampled
    return (time.perf_counter() - start) * 1000 / tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    threads = setup_threads()
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in SHAPES:
            model = load_model(save_model(os.path.join(tmp, family), family), default_cache_dir())
            blocks = -(-(PROMPT + args.tokens) // BLOCK)
            runner = ModelRunner(
                model,
                blocks,
                BLOCK,
                PROMPT + args.tokens,
                "cpu",
                "float32",
                "q8_0",
                "native",
                kv_dtype="float16",
            )
            decoder = runner.transformer.decoder
            assert decoder is not None
            times: dict[str, list[float]] = {"per-op": [], "native decoder": []}
            for run in range(args.runs):
                for name in times:
                    runner.transformer.decoder = decoder if name == "native decoder" else None
                    times[name].append(ms_per_token(runner, args.tokens, seed=run))
            results[family] = times
    lines = [
        "One decode stream, ms per token, random models of hidden 640 and 18 layers (the MoE: 8 experts "
        "of 512, top-2), Q8_0 products, "
        f"float16 KV, {threads} thread(s), {args.runs} alternating runs of {args.tokens} tokens after a "
        f"{PROMPT}-token prompt: the median run (the best run).",
        "",
        "| model | per-op path | native decoder | speedup |",
        "|---|---:|---:|---:|",
    ]
    for family, times in results.items():
        per_op, native = (statistics.median(times[n]) for n in ("per-op", "native decoder"))
        best = (min(times[n]) for n in ("per-op", "native decoder"))
        lines.append(
            f"| {family} | {per_op:.2f} ({next(best):.2f}) | {native:.2f} ({next(best):.2f}) | "
            f"{per_op / native:.2f}x |"
        )
    write_results(
        "family_decoder", {"threads": threads, "tokens": args.tokens, "ms": results}, "\n".join(lines) + "\n"
    )


if __name__ == "__main__":
    main()
