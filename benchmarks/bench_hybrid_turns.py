"""A 10-turn chat on a Qwen3.5-shaped hybrid model (random weights): does the next turn cost what an
attention model's does?

The shape is Qwen3.5-0.8B's, the smallest released Qwen3.5 (transformers' Qwen3_5TextConfig defaults
are a 4,096-wide, 32-layer model): 24 layers, 18 Gated DeltaNet (16 key and 16 value heads of 128, a
4-tap convolution) and 6 gated attention layers (8 query heads, 2 KV heads of 256, a quarter of each
rotated), hidden 1,024, MLP 3,584, a tied 248,320-token vocabulary. Random bfloat16 weights, the default
model's tokenizer and chat template (its ids are a prefix of the vocabulary).

Per turn: the time to first token, the prompt, the cached tokens against the ideal (everything before
the new message: the previous prompt and all of its reply but the last sampled token) and the tokens
recomputed for want of a checkpoint. Then the target ratio, TTFT of turn 10 over turn 2 (<= 1.3x), and the
state memory: bytes per sequence's state (one live slot), per checkpoint, the checkpoints the cache kept,
each also in tokens of this model's KV.

Run: `python -m benchmarks.bench_hybrid_turns` (writes benchmarks/results/hybrid_turns.{json,md}).
"""

import argparse
import os
import shutil
import tempfile
import time
from typing import Any

import torch

from benchmarks.common import make_engine, setup_threads, write_results
from kvserve.config import default_cache_dir
from kvserve.engine.engine import Engine
from kvserve.engine.factory import state_slots
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.kv_quant import kv_bytes_per_token
from kvserve.model.loader import load_model, tokenizer_dir
from kvserve.model.recurrent import state_specs
from kvserve.model.runner import TORCH_DTYPES
from kvserve.model.tokenizer import MessageDict
from kvserve_bench.tokens import text_of_tokens

QWEN3_5_0_8B: dict[str, Any] = {
    "vocab_size": 248320,
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 24,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def build_model(folder: str) -> str:
    """Save a random Qwen3.5-0.8B-shaped model with the default model's tokenizer files into `folder`."""
    import transformers

    config = transformers.Qwen3_5TextConfig(**QWEN3_5_0_8B)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    source = tokenizer_dir(None, default_cache_dir())
    for name in os.listdir(source):
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(os.path.join(source, name), folder)
    return folder


def turn(engine: Engine, rid: str, ids: list[int], reply_tokens: int) -> dict[str, Any]:
    start, cpu = time.perf_counter(), time.process_time()
    engine.add_request(rid, ids, SamplingParams(max_tokens=reply_tokens, temperature=0, ignore_eos=True))
    first: float | None = None
    first_cpu = 0.0
    text, tokens, cached, recomputed = "", 0, 0, 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if first is None:
                first, first_cpu = time.perf_counter(), time.process_time()
            text += delta.text
            tokens += len(delta.token_ids)
            cached, recomputed = delta.num_cached_tokens, delta.num_recomputed_tokens
    ttft = (first or time.perf_counter()) - start
    # The process's CPU time to the first token: what the turn cost, less what other jobs on a shared
    # machine took from it (wall time counts their share too).
    return {
        "ttft_s": ttft,
        "ttft_cpu_s": first_cpu - cpu,
        "text": text,
        "reply_tokens": tokens,
        "cached": cached,
        "recomputed": recomputed,
    }


def chat(
    engine: Engine, turns: int, system: int, user: int, reply: int, key: str = ""
) -> list[dict[str, Any]]:
    tok = engine.tokenizer

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    messages: list[MessageDict] = [
        {"role": "system", "content": text_of_tokens(system, f"{key}system", count)}
    ]
    rows: list[dict[str, Any]] = []
    ideal = 0
    for t in range(turns):
        messages.append({"role": "user", "content": text_of_tokens(user, f"{key}user-{t}", count)})
        ids = tok.encode_chat(messages, known_reply=lambda text: engine.replies.lookup("", text))
        row = turn(engine, f"{key}turn{t}", ids, reply)
        row |= {"turn": t + 1, "prompt_tokens": len(ids), "ideal_cached": ideal}
        rows.append(row)
        messages.append({"role": "assistant", "content": row.pop("text")})
        ideal = len(ids) + row["reply_tokens"] - 1
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--system", type=int, default=400, help="system prompt tokens")
    parser.add_argument("--user", type=int, default=40, help="tokens of each user message")
    parser.add_argument("--reply", type=int, default=32, help="tokens of each reply")
    parser.add_argument("--state-checkpoints", type=int, default=32)
    args = parser.parse_args()
    threads = setup_threads()
    # The weights are read lazily: the folder outlives the engine.
    with tempfile.TemporaryDirectory(prefix="kvserve-qwen3_5-") as folder:
        model = load_model(build_model(folder), default_cache_dir())
        engine = make_engine(
            model,
            kv_cache_memory=2**30,
            max_model_len=4096,
            max_num_seqs=2,
            state_checkpoints=args.state_checkpoints,
        )
        # A short chat of other words first: the kernels and the resume path warmed up, so that turn 2
        # is not the first resume from a checkpoint.
        chat(engine, 3, args.system // 4, args.user, args.reply, key="warm-")
        before = engine.stats().cache.num_state_checkpoints
        rows = chat(engine, args.turns, args.system, args.user, args.reply)
        stats = engine.stats()
        engine.close()
    config = model.config
    state_bytes = sum(
        s.num_bytes for s in state_specs(config, TORCH_DTYPES[engine.config.dtype]) if s is not None
    )
    kv_token = kv_bytes_per_token(config, engine.config.kv_cache_dtype)
    conversation = rows[-1]["prompt_tokens"] + rows[-1]["reply_tokens"]
    kept = stats.cache.num_state_checkpoints - before
    live, _, pool_bytes = state_slots(engine.config, model)
    results: dict[str, Any] = {
        "shape": "Qwen3.5-0.8B",
        "threads": threads,
        "turns": rows,
        "ttft_turn10_over_turn2": rows[-1]["ttft_s"] / rows[1]["ttft_s"],
        "ttft_cpu_turn10_over_turn2": rows[-1]["ttft_cpu_s"] / rows[1]["ttft_cpu_s"],
        "recomputed_tokens": stats.recomputed_tokens,
        "state_bytes_per_sequence": state_bytes,
        "kv_bytes_per_token": kv_token,
        "checkpoints_kept": kept,
        "live_slots": live,
        "state_pool_bytes": pool_bytes,
        "conversation_tokens": conversation,
    }
    lines = [
        f"Qwen3.5-0.8B shape, random weights, {threads} threads, KV {engine.config.kv_cache_dtype}",
        "",
        "| turn | prompt | cached | ideal | recomputed | cached / prompt | TTFT / turn 2 | CPU / turn 2 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['turn']} | {r['prompt_tokens']} | {r['cached']} | {r['ideal_cached']} | {r['recomputed']} "
            f"| {r['cached'] / r['prompt_tokens']:.3f} | {r['ttft_s'] / rows[1]['ttft_s']:.2f} "
            f"| {r['ttft_cpu_s'] / rows[1]['ttft_cpu_s']:.2f} |"
        )
    lines += [
        "",
        f"TTFT turn 10 / turn 2: {results['ttft_turn10_over_turn2']:.2f}x wall, "
        f"{results['ttft_cpu_turn10_over_turn2']:.2f}x CPU (turn 1: "
        f"{rows[0]['ttft_s'] / rows[1]['ttft_s']:.1f}x turn 2)",
        f"state per sequence (one slot, {engine.config.dtype}): {state_bytes:,} bytes = "
        f"{state_bytes / kv_token:.0f} tokens of KV ({kv_token:,} bytes a token); a checkpoint is one slot",
        f"live state per sequence: one slot, and the engine's one scratch slot shared by its {live} "
        f"sequences ({(1 + live) / live:.2f}x the bare state at {live}); pool {pool_bytes:,} bytes",
        f"checkpoints the chat added: {kept} ({kept * state_bytes:,} bytes, "
        f"{kept * state_bytes / conversation:,.0f} bytes per token of the {conversation}-token conversation)",
        "",
    ]
    write_results("hybrid_turns", results, "\n".join(lines))


if __name__ == "__main__":
    main()
