"""Decode speed of a Qwen3-MoE against a dense Qwen3 of the same active size, through the offline API.

Both models are random, built by transformers and saved as Hugging Face folders with the default model's
tokenizer: hidden 512, 8 query and 4 KV heads of 64, 4 layers. The MoE has 8 experts of 768 and takes 2
per token; the dense model's MLP is 1,536 wide, so a token reads the same product bytes in both (the MoE
adds its router, 8 x 512). Both run Q8_0 blocks made at load (`weight_dtype="q8_0"`: the native products
a Q8_0 GGUF runs), float16 KV. The two models alternate run by run in one process, so a shared machine's
load hits both alike; each figure is the median of the runs, and the best run.

Reported: decode tokens/s of one stream, and of 8 streams decoding together (the 8 share no prefix).
Run: `make bench-moe` (writes
benchmarks/results/moe.{json,md}).
"""

import argparse
import os
import random
import shutil
import statistics
import tempfile
from typing import Any

import torch

from benchmarks.common import setup_threads, write_results
from kvserve import LLM, SamplingParams
from kvserve.config import default_cache_dir
from kvserve.model.loader import tokenizer_dir

SHAPE: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
EXPERTS, TOP_K, EXPERT_SIZE = 8, 2, 768


def save_model(path: str, moe: bool) -> str:
    import transformers

    if moe:
        config: Any = transformers.Qwen3MoeConfig(
            **SHAPE,
            intermediate_size=TOP_K * EXPERT_SIZE,
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=EXPERT_SIZE,
            norm_topk_prob=True,
        )
        model: Any = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.Qwen3Config(**SHAPE, intermediate_size=TOP_K * EXPERT_SIZE)
        model = transformers.Qwen3ForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.save_pretrained(path, safe_serialization=True)
    default_dir = tokenizer_dir(None, default_cache_dir())
    for name in os.listdir(default_dir):
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(os.path.join(default_dir, name), path)
    return path


def decode_rate(llm: LLM, streams: int, tokens: int, seed: int) -> float:
    """Decode tokens/s over `streams` prompts of 32 fresh tokens decoding together: the tokens after each
    stream's first, over the time from the last first token to the last reply."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    rng = random.Random(seed)
    batch = [{"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(32)]} for _ in range(streams)]
    outputs = llm.generate(batch, params)
    decoded = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    start = max(o.metrics["first_token_latency"] for o in outputs)
    end = max(o.metrics["latency"] for o in outputs)
    return decoded / (end - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    threads = setup_threads()
    with tempfile.TemporaryDirectory() as tmp:
        llms = {
            name: LLM(
                save_model(os.path.join(tmp, name), name == "moe"),
                weight_dtype="q8_0",
                threads=threads,
                kv_cache_memory=256 * 2**20,
                enable_prefix_caching=False,
            )
            for name in ("moe", "dense")
        }
        rates: dict[str, dict[int, list[float]]] = {name: {1: [], 8: []} for name in llms}
        for run in range(args.runs):
            for streams in (1, 8):
                for name, llm in llms.items():
                    rates[name][streams].append(decode_rate(llm, streams, args.tokens, seed=run))
    medians = {name: {s: statistics.median(v) for s, v in by.items()} for name, by in rates.items()}
    best = {name: {s: max(v) for s, v in by.items()} for name, by in rates.items()}
    lines = [
        f"Decode tokens/s, Qwen3-MoE ({EXPERTS} experts of {EXPERT_SIZE}, top-{TOP_K}) against a dense "
        f"Qwen3 with a {TOP_K * EXPERT_SIZE}-wide MLP (same active size), hidden 512, 4 layers, Q8_0 "
        f"products, {threads} thread(s), {args.runs} alternating runs of {args.tokens} tokens: the median "
        "run and the best (the least disturbed by other work on the machine).",
        "",
        "| | MoE | dense | MoE / dense |",
        "|---|---:|---:|---:|",
    ]
    for streams in (1, 8):
        label = "one stream" if streams == 1 else f"{streams} streams together"
        for kind, figures in (("median", medians), ("best", best)):
            moe, dense = figures["moe"][streams], figures["dense"][streams]
            lines.append(f"| {label}, {kind} | {moe:.1f} | {dense:.1f} | {moe / dense:.2f}x |")
    write_results(
        "moe",
        {"threads": threads, "tokens": args.tokens, "runs": rates, "medians": medians, "best": best},
        "\n".join(lines) + "\n",
    )


if __name__ == "__main__":
    main()
