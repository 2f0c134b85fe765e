"""Time per token of one decode stream with the one-call native decoder against the per-op path, on
random models that transformers builds, hidden 640 and 18 layers: Gemma 3 (4 query heads and 1 KV head
of 256, its sliding layers, GeGLU, post norms), Qwen3 (8 query and 2 KV heads of 128, q/k norms), a
Qwen3-MoE of Qwen3's attention with 8 experts of 512, top-2, and the families with their own layers: a
gpt-oss (sinks, 128-token windows on alternate layers, 8 clamped experts of 512, top-2), an LFM2 (short
convolutions, attention in every third layer) and a Qwen3.5 (three Gated DeltaNet layers in four, 8 key
and 16 value heads of 64; gated attention). Q8_0 blocks made at load (`weight_dtype="q8_0"`), a float16
KV cache. The runner is driven directly: a 32-token prompt, then `--tokens` greedy decodes; the two paths
alternate run by run in one process (the per-op path by detaching the decoder), so a shared machine's load
hits both alike. Reported: the median run's ms per token and the best run's, and the median run's thread
CPU time per token (the whole step's with one thread: `KVSERVE_BENCH_THREADS=1`). `--families` picks some.

Run: `make bench-family-decoder` (writes benchmarks/results/family_decoder.{json,md}).
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from benchmarks.common import setup_threads, write_results
from kvserve.config import default_cache_dir
from kvserve.model.loader import load_model, tokenizer_dir
from kvserve.model.recurrent import ZERO
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
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "intermediate_size": 512,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": 128,
        },
    ),
    "lfm2": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "block_auto_adjust_ff_dim": False,
            "layer_types": ["conv", "conv", "full_attention"] * 6,
            "tie_word_embeddings": True,
        },
    ),
    "qwen3_5": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        {
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "linear_num_key_heads": 8,
            "linear_num_value_heads": 16,
            "linear_key_head_dim": 64,
            "linear_value_head_dim": 64,
            "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 4 + ["linear_attention"] * 2,
            "tie_word_embeddings": True,
        },
    ),
}
PROMPT = 32
BLOCK = 16


def save_model(path: str, family: str) -> str:
    import transformers

    config_name, model_name, shape = SHAPES[family]
    config = getattr(transformers, config_name)(**{**COMMON, **shape})
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.save_pretrained(path, safe_serialization=True)
    # The default model's tokenizer (a family without its own files would find none).
    default_dir = tokenizer_dir(None, default_cache_dir())
    for name in os.listdir(default_dir):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(default_dir, name), path)
    return path


def ms_per_token(runner: ModelRunner, tokens: int, seed: int) -> tuple[float, float]:
    """Mean wall and thread CPU ms per decode step of one stream after a fresh prompt (a hybrid model's
    state in slot 1, zeroed first)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 4000, (PROMPT,), generator=gen).tolist()
    table = list(range(-(-(PROMPT + tokens) // BLOCK)))
    if runner.state is not None:
        runner.state.apply([(ZERO, 1)])
    prompt = SequenceChunk(ids, 0, table, True, state_slot=1)
    logits = runner.execute(ForwardBatch(prefills=[prompt])).sampled
    start, cpu = time.perf_counter(), time.thread_time()
    for _ in range(tokens):
        ids.append(int(logits[0].argmax()))
        step = ForwardBatch(decodes=[SequenceChunk(ids[-1:], len(ids) - 1, table, True, state_slot=1)])
        logits = runner.execute(step).sampled
    return (time.perf_counter() - start) * 1000 / tokens, (time.thread_time() - cpu) * 1000 / tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--families", nargs="*", choices=sorted(SHAPES), default=list(SHAPES))
    args = parser.parse_args()
    threads = setup_threads()
    results: dict[str, dict[str, list[float]]] = {}
    cpu: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
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
                num_state_slots=2,
            )
            decoder = runner.transformer.decoder
            assert decoder is not None
            times: dict[str, list[float]] = {"per-op": [], "native decoder": []}
            cpu[family] = {name: [] for name in times}
            for run in range(args.runs):
                for name in times:
                    runner.transformer.decoder = decoder if name == "native decoder" else None
                    wall, thread = ms_per_token(runner, args.tokens, seed=run)
                    times[name].append(wall)
                    cpu[family][name].append(thread)
            results[family] = times
    lines = [
        "One decode stream, ms per token, random models of hidden 640 and 18 layers (MoEs: 8 experts "
        "of 512, top-2; bench_family_decoder.py has the shapes), Q8_0 products, "
        f"float16 KV, {threads} thread(s), {args.runs} alternating runs of {args.tokens} tokens after a "
        f"{PROMPT}-token prompt: the median run (the best run).",
        "",
        "| model | per-op path | native decoder | speedup | thread CPU per-op / native |",
        "|---|---:|---:|---:|---:|",
    ]
    for family, times in results.items():
        per_op, native = (statistics.median(times[n]) for n in ("per-op", "native decoder"))
        best = (min(times[n]) for n in ("per-op", "native decoder"))
        cpu_per_op, cpu_native = (statistics.median(cpu[family][n]) for n in ("per-op", "native decoder"))
        lines.append(
            f"| {family} | {per_op:.2f} ({next(best):.2f}) | {native:.2f} ({next(best):.2f}) | "
            f"{per_op / native:.2f}x | {cpu_per_op:.2f} / {cpu_native:.2f} |"
        )
    write_results(
        "family_decoder",
        {"threads": threads, "tokens": args.tokens, "ms": results, "thread_cpu_ms": cpu},
        "\n".join(lines) + "\n",
    )


if __name__ == "__main__":
    main()
