"""kvserve beside llama.cpp's llama-server on any GGUF, both with 2 threads, in one run: `make bench-peer
MODEL=path`.

Each server is started twice, one after the other: the first start's load time (kvserve's includes
converting a GGUF it has not seen) and llama-server's KV size, read from its log (`-lv 4`: its
"llama_kv_cache: size = ... MiB" lines, summed over the global and sliding-window caches, and for a
hybrid model its "llama_memory_recurrent: size" line, the states kvserve also holds in its
--kv-cache-memory); then both are started again (load time: process start to /health answering), kvserve
with the same bytes, and measured side by side (`--prefill-tokens` and `--turns` shorten the run):

- cold prefill tok/s at 200, 800 and 2,000 tokens: a non-streamed completion of 1 token on a prompt that
  neither server has seen, timed from the client (prompt tokens from the server's usage);
- time per output token (TPOT) at 1 and 4 streams: 64-token streamed chat replies, (end - first token) /
  (tokens - 1), the streams sent at once;
- multi-turn TTFT: one chat of 4 turns over a 500-token system prompt, each turn resending the history;
  turn 1 is cold, turns 2-4 reuse each server's cache;
- resident memory (RSS) at idle, both started, and again once the workload is done, at equal KV bytes
  (llama-server with --cache-ram 0);
- quality, after the servers stop: teacher-forced top-1 agreement of kvserve's engine, in process, with
  transformers' float32 model on the same GGUF dequantized (`from_pretrained(folder, gguf_file=name)`),
  over a fixed text of 600 tokens (the prefill rows, with prompt_logprobs) and 32 greedy tokens after it
  (the decode rows: transformers reads the same 632 tokens).

kvserve runs with `--speculative off` unless --kvserve-args says otherwise: a random-weight model loops
greedily, and drafting from a loop would measure the loop, not the model. Reports go to
benchmarks/results/peer-<model name>/ (summary.json, summary.md). Never part of `make test` or CI.
"""

import argparse
import asyncio
import gc
import os
import re
import shlex
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import gguf
import httpx
import numpy as np
import psutil
import torch

from benchmarks.bench_peer import KVSERVE, LLAMA, MIB, PORT, build_llama_server, listening_pid, llama_server
from benchmarks.common import RESULTS, write_results
from kvserve.config import default_cache_dir
from kvserve.model.loader import model_name
from kvserve_bench.client import RequestResult, Target, stream_chat
from kvserve_bench.servers import local_servers
from kvserve_bench.tokens import remote_counter, text_of_tokens, text_only

PREFILL_TOKENS = (200, 800, 2000)
REPLY_TOKENS = 64
STREAMS = (1, 4)
SYSTEM_TOKENS, USER_TOKENS, TURNS, TURN_REPLY_TOKENS = 500, 40, 4, 32
QUALITY_TOKENS, QUALITY_DECODE = 600, 32
# Its KV caches' sizes, and a hybrid model's recurrent states' (kvserve holds both in --kv-cache-memory).
_KV_LINE = re.compile(r"llama_(?:kv_cache|memory_recurrent): size =\s*([\d.]+) MiB")


@dataclass
class Figures:
    """One server's numbers (seconds, tokens/s, bytes)."""

    load_first_s: float = 0.0
    load_s: float = 0.0
    rss_idle: int = 0
    rss_after: int = 0
    prefill_tok_s: dict[int, float] = field(default_factory=dict)
    tpot_s: dict[int, float] = field(default_factory=dict)
    ttft_turns_s: list[float] = field(default_factory=list)


def llama_kv_bytes(log: str) -> int:
    """The KV bytes llama-server's log reports, every cache summed (global and sliding-window)."""
    with open(log, errors="replace") as f:
        sizes = [float(m.group(1)) for m in _KV_LINE.finditer(f.read())]
    if not sizes:
        raise RuntimeError(f"llama-server's log {log} names no KV size")
    return round(sum(sizes) * MIB)


def prefill(client: httpx.Client, url: str, model: str, text: str) -> float:
    """Prompt tokens per second of a 1-token completion, timed end to end."""
    body = {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    response = client.post(f"{url}/v1/completions", json=body)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    return int(response.json()["usage"]["prompt_tokens"]) / elapsed


async def chat(
    url: str, model: str, messages: list[list[dict[str, str]]], max_tokens: int
) -> list[RequestResult]:
    """The conversations' next replies, sent at once."""
    target = Target("", url, model)
    results = [RequestResult("", str(i), 0, 0, 0.0) for i in range(len(messages))]
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(
            *(
                stream_chat(client, target, m, max_tokens, 0, r)
                for m, r in zip(messages, results, strict=True)
            )
        )
    for r in results:
        if r.error:
            raise RuntimeError(f"{url}: {r.error}")
    return results


def measure(
    urls: dict[str, str],
    model: str,
    figures: dict[str, Figures],
    repeats: int,
    prefills: tuple[int, ...] = PREFILL_TOKENS,
    turns: int = TURNS,
) -> None:
    with httpx.Client(timeout=600) as client:
        count = remote_counter(client, urls[KVSERVE])
        assert count is not None, "kvserve answers /tokenize"
        count = text_only(count)
        for n in prefills:
            for rep in range(repeats):
                text = text_of_tokens(n, f"peer-model/prefill/{n}/{rep}", count)
                for name, url in urls.items():
                    figures[name].prefill_tok_s.setdefault(n, 0.0)
                    rate = prefill(client, url, model, text)
                    # The best of the repeats: the machine is shared, noise only slows a run down.
                    figures[name].prefill_tok_s[n] = max(figures[name].prefill_tok_s[n], rate)
        for streams in STREAMS:
            for rep in range(repeats):
                for name, url in urls.items():
                    asks = [
                        [{"role": "user", "content": text_of_tokens(32, f"tpot/{streams}/{rep}/{i}", count)}]
                        for i in range(streams)
                    ]
                    results = asyncio.run(chat(url, model, asks, REPLY_TOKENS))
                    tpot = statistics.mean(r.tpot_s for r in results if r.tpot_s is not None)
                    best = figures[name].tpot_s.get(streams)
                    figures[name].tpot_s[streams] = tpot if best is None else min(best, tpot)
        system = text_of_tokens(SYSTEM_TOKENS, "peer-model/system", count)
        for name, url in urls.items():
            history = [{"role": "system", "content": system}]
            for turn in range(turns):
                history.append(
                    {"role": "user", "content": text_of_tokens(USER_TOKENS, f"turn/{turn}", count)}
                )
                (result,) = asyncio.run(chat(url, model, [history], TURN_REPLY_TOKENS))
                assert result.ttft_s is not None
                figures[name].ttft_turns_s.append(result.ttft_s)
                history.append({"role": "assistant", "content": result.reply})


def quality(model: str, cache_dir: str) -> dict[str, Any]:
    """Teacher-forced top-1 agreement of kvserve's engine with transformers' float32 model on the file."""
    from transformers import AutoModelForCausalLM

    from kvserve.config import EngineConfig
    from kvserve.engine.engine import Engine
    from kvserve.engine.sampling_params import SamplingParams

    torch.set_num_threads(2)
    engine = Engine.from_config(EngineConfig(model=model, cache_dir=cache_dir, kv_cache_memory=256 * 2**20))
    tokenizer = engine.tokenizer
    count = text_only(lambda text: len(tokenizer.encode(text)))
    prompt = tokenizer.encode(text_of_tokens(QUALITY_TOKENS, "peer-model/quality", count))
    params = SamplingParams(max_tokens=QUALITY_DECODE, temperature=0, prompt_logprobs=1, ignore_eos=True)
    engine.add_request("quality", prompt, params)
    ours_prompt: list[int] = []
    generated: list[int] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            generated += delta.token_ids
            if delta.prompt_logprobs is not None:
                ours_prompt = [p.top[0][0] for p in delta.prompt_logprobs[1:] if p is not None]
    del engine
    gc.collect()
    folder, name = os.path.split(os.path.abspath(model))
    if gguf.GGUFReader(model).fields["general.architecture"].contents() == "gpt-oss":
        theirs = gpt_oss_reference(model)
    else:
        theirs = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        logits = theirs(torch.tensor([prompt + generated])).logits[0]
    top = logits.argmax(-1).tolist()
    # Position i's logits predict token i + 1: the prompt's rows predict tokens 1..n-1 (kvserve's
    # prompt_logprobs), the rows from n-1 on predict the generated tokens.
    their_prompt = top[: len(prompt) - 1]
    their_decode = top[len(prompt) - 1 : len(prompt) - 1 + len(generated)]
    return {
        "prompt_tokens": len(prompt),
        "prefill_agreement": _agreement(ours_prompt, their_prompt),
        "decode_tokens": len(generated),
        "decode_agreement": _agreement(generated, their_decode),
    }


def gpt_oss_reference(model: str) -> Any:
    """transformers' float32 gpt-oss on the file's dequantized tensors. transformers' own GGUF loader
    reads no gpt-oss experts (they come up newly initialized) and misreads the rope scaling keys, so
    the model is built here: the config from the metadata, the experts' gate and up interleaved back
    into `gate_up_proj` [experts, hidden, 2 * width] as OpenAI's checkpoints hold them."""
    from transformers import GptOssConfig, GptOssForCausalLM

    reader = gguf.GGUFReader(model)

    def key(name: str) -> Any:
        return reader.fields[f"gpt-oss.{name}"].contents()

    tensors = {
        t.name: torch.from_numpy(
            np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).copy()
        ).reshape(tuple(int(d) for d in reversed(t.shape)))
        for t in reader.tensors
    }
    layers = int(key("block_count"))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(key("rope.freq_base"))}
    if "gpt-oss.rope.scaling.factor" in reader.fields:
        rope |= {"rope_type": "yarn", "factor": float(key("rope.scaling.factor")), "truncate": False}
        rope |= {"original_max_position_embeddings": int(key("rope.scaling.original_context_length"))}
        rope |= {"beta_fast": 32.0, "beta_slow": 1.0}
    config = GptOssConfig(
        vocab_size=tensors["token_embd.weight"].shape[0],
        hidden_size=int(key("embedding_length")),
        intermediate_size=int(key("expert_feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=int(key("attention.head_count")),
        num_key_value_heads=int(key("attention.head_count_kv")),
        head_dim=int(key("attention.key_length")),
        num_local_experts=int(key("expert_count")),
        num_experts_per_tok=int(key("expert_used_count")),
        sliding_window=int(key("attention.sliding_window")),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(key("context_length")),
        rope_parameters=rope,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        tie_word_embeddings=False,
    )
    ours = GptOssForCausalLM(config).float().eval()  # type: ignore[no-untyped-call]
    state = {
        "model.embed_tokens.weight": tensors["token_embd.weight"],
        "model.norm.weight": tensors["output_norm.weight"],
        "lm_head.weight": tensors["output.weight"],
    }
    for i in range(layers):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        state[h + "input_layernorm.weight"] = tensors[b + "attn_norm.weight"]
        state[h + "post_attention_layernorm.weight"] = tensors[b + "post_attention_norm.weight"]
        for gguf_name, proj in (("attn_q", "q"), ("attn_k", "k"), ("attn_v", "v"), ("attn_output", "o")):
            for part in ("weight", "bias"):
                state[f"{h}self_attn.{proj}_proj.{part}"] = tensors[f"{b}{gguf_name}.{part}"]
        state[h + "self_attn.sinks"] = tensors[b + "attn_sinks.weight"]
        state[h + "mlp.router.weight"] = tensors[b + "ffn_gate_inp.weight"]
        state[h + "mlp.router.bias"] = tensors[b + "ffn_gate_inp.bias"]
        gate, up = tensors[b + "ffn_gate_exps.weight"], tensors[b + "ffn_up_exps.weight"]
        gate_up = torch.stack((gate.transpose(1, 2), up.transpose(1, 2)), dim=-1).flatten(-2)
        bias = torch.stack((tensors[b + "ffn_gate_exps.bias"], tensors[b + "ffn_up_exps.bias"]), dim=-1)
        state[h + "mlp.experts.gate_up_proj"] = gate_up
        state[h + "mlp.experts.gate_up_proj_bias"] = bias.flatten(-2)
        state[h + "mlp.experts.down_proj"] = tensors[b + "ffn_down_exps.weight"].transpose(1, 2)
        state[h + "mlp.experts.down_proj_bias"] = tensors[b + "ffn_down_exps.bias"]
    missing, unexpected = ours.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"gpt-oss reference: missing {missing}, unexpected {unexpected}")
    return ours


def _agreement(ours: list[int], theirs: list[int]) -> float:
    if len(ours) != len(theirs) or not ours:
        raise RuntimeError(f"{len(ours)} positions against {len(theirs)}")
    return sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(ours)


def run(
    model: str,
    repeats: int,
    kvserve_args: list[str],
    results: str,
    skip_quality: bool,
    prefills: tuple[int, ...] = PREFILL_TOKENS,
    turns: int = TURNS,
) -> None:
    binary = build_llama_server(os.path.join(default_cache_dir(), "peer"))
    name = model_name(model)
    figures = {KVSERVE: Figures(), LLAMA: Figures()}
    flags = ["--model", model, "--threads", "2", "--speculative", "off", *kvserve_args]
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "llama.log")
        start = time.perf_counter()
        with llama_server(binary, PORT, model=model, log=log, extra=["-lv", "4"]):
            figures[LLAMA].load_first_s = time.perf_counter() - start
        kv = llama_kv_bytes(log)
    flags += ["--kv-cache-memory", f"{kv // 1024}KiB"]
    start = time.perf_counter()
    with local_servers([flags], 1800):
        figures[KVSERVE].load_first_s = time.perf_counter() - start
    start = time.perf_counter()
    with llama_server(binary, PORT, model=model) as llama_url:
        figures[LLAMA].load_s = time.perf_counter() - start
        start = time.perf_counter()
        with local_servers([flags], 1800) as (kvserve_url,):
            figures[KVSERVE].load_s = time.perf_counter() - start
            urls = {KVSERVE: kvserve_url, LLAMA: llama_url}
            for server, url in urls.items():
                figures[server].rss_idle = int(psutil.Process(listening_pid(url)).memory_info().rss)
            measure(urls, name, figures, repeats, prefills, turns)
            # Idle again after the workload: every page a request reads (the weights) is resident now.
            for server, url in urls.items():
                figures[server].rss_after = int(psutil.Process(listening_pid(url)).memory_info().rss)
    scores = None if skip_quality else quality(model, default_cache_dir())
    data, table = summary(name, kv, figures, scores)
    write_results("summary", data, table, os.path.join(results, f"peer-{name}"))


def summary(
    name: str, kv: int, figures: dict[str, Figures], scores: dict[str, Any] | None
) -> tuple[dict[str, Any], str]:
    """The figures as JSON and as a Markdown table of ratios."""
    ours, theirs = figures[KVSERVE], figures[LLAMA]
    rows: list[tuple[str, float, float, str, float]] = []  # label, kvserve, llama.cpp, unit, scale

    def add(label: str, a: float, b: float, unit: str, scale: float = 1.0) -> None:
        rows.append((label, a, b, unit, scale))

    for n in ours.prefill_tok_s:
        add(
            f"cold prefill, {n:,} tokens (tok/s, higher is better)",
            ours.prefill_tok_s[n],
            theirs.prefill_tok_s[n],
            "",
        )
    for streams in STREAMS:
        label = f"TPOT, {streams} stream{'s' if streams > 1 else ''} (ms)"
        add(label, ours.tpot_s[streams], theirs.tpot_s[streams], "ms", 1000)
    if len(ours.ttft_turns_s) > 1:
        turns = len(ours.ttft_turns_s)
        add("multi-turn TTFT, turn 1, cold (ms)", ours.ttft_turns_s[0], theirs.ttft_turns_s[0], "ms", 1000)
        later = statistics.mean(ours.ttft_turns_s[1:]), statistics.mean(theirs.ttft_turns_s[1:])
        add(f"multi-turn TTFT, turns 2-{turns}, mean (ms)", *later, "ms", 1000)
    add("load, first start (s)", ours.load_first_s, theirs.load_first_s, "s")
    add("load, second start (s)", ours.load_s, theirs.load_s, "s")
    add("RSS at idle (MiB)", ours.rss_idle, theirs.rss_idle, "MiB", 1 / MIB)
    add("RSS at idle after the workload (MiB)", ours.rss_after, theirs.rss_after, "MiB", 1 / MIB)
    lines = [
        f"kvserve and llama-server on {name}, 2 threads each, {kv / MIB:.0f} MiB of KV (and recurrent "
        "state) each (llama-server's own size; --cache-ram 0); kvserve with --speculative off. Best of the "
        "repeats.\n",
        "| measure | kvserve | llama.cpp | kvserve / llama.cpp |",
        "|---|---:|---:|---:|",
    ]
    for label, a, b, _, scale in rows:
        lines.append(f"| {label} | {a * scale:,.1f} | {b * scale:,.1f} | {a / b:.2f}x |")
    if scores is not None:
        lines.append(
            "\nQuality: kvserve's top-1 next token agrees with transformers' float32 on the dequantized "
            f"file at {scores['prefill_agreement']:.1%} of {scores['prompt_tokens'] - 1} prompt positions "
            "(prefill) "
            f"and {scores['decode_agreement']:.1%} of {scores['decode_tokens']} generated ones (decode), "
            "teacher-forced."
        )
    data = {
        "model": name,
        "kv_bytes": kv,
        "servers": {server: f.__dict__ for server, f in figures.items()},
        "ratios": {label: a / b for label, a, b, _, _ in rows},
        "quality": scores,
    }
    return data, "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model", help="a GGUF file")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each measure (default %(default)s)")
    parser.add_argument("--kvserve-args", default="", help="extra `kvserve serve` flags, one string")
    parser.add_argument("--results", default=RESULTS, help="folder of the reports (default %(default)s)")
    parser.add_argument("--skip-quality", action="store_true", help="no comparison with transformers")
    parser.add_argument(
        "--prefill-tokens",
        default=",".join(map(str, PREFILL_TOKENS)),
        help="cold prompt lengths, comma-separated (default %(default)s)",
    )
    parser.add_argument(
        "--turns", type=int, default=TURNS, help="multi-turn chat turns, 0: none (default %(default)s)"
    )
    args = parser.parse_args()
    run(
        os.path.abspath(args.model),
        args.repeats,
        shlex.split(args.kvserve_args),
        args.results,
        args.skip_quality,
        tuple(int(n) for n in args.prefill_tokens.split(",") if n),
        args.turns,
    )


if __name__ == "__main__":
    main()
