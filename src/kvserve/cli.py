"""kvserve command line: serve | chat | generate | bench."""

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from kvserve.config import KV_DTYPES, WEIGHT_DTYPES, EngineConfig, parse_bytes
from kvserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvserve.engine.engine import Engine
    from kvserve.llm import LLM


def _engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--kv-cache-memory", default="2GiB", help="KV cache budget, e.g. 512MiB or 2GiB")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: the model's)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=64, help="requests decoded together at most")
    parser.add_argument(
        "--max-sequences-per-request",
        type=_positive_int,
        default=256,
        help="sequences (prompts x n) one request may start before answering 400 (default %(default)s)",
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=1024, help="tokens per forward pass at most"
    )
    parser.add_argument(
        "--no-prefix-cache", action="store_true", help="disable prefix caching (for baselines)"
    )
    parser.add_argument(
        "--kv-disk",
        default=None,
        metavar="DIR",
        help="disk tier: keep KV blocks in DIR too, found again after eviction or a restart",
    )
    parser.add_argument("--kv-disk-size", default="20GiB", help="disk tier budget, e.g. 20GiB")
    parser.add_argument(
        "--max-pinned-tokens",
        type=int,
        default=0,
        help="KV tokens that POST /v1/cache/pin may hold in memory (held back from requests); 0: off",
    )
    parser.add_argument(
        "--max-pinned-tokens-per-tenant",
        type=int,
        default=None,
        help="of those, what one tenant (or shared group) may pin (default: all of them)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"])
    parser.add_argument(
        "--weight-dtype",
        default=EngineConfig.weight_dtype,
        choices=WEIGHT_DTYPES,
        help="storage of the linear weights: gguf (a GGUF's own quantized blocks, run natively; the "
        "float32 model at a fraction of its bytes; float16 for other models), q8_0 (8-bit blocks made at "
        "load), float32 (exact), float16 (half the bytes) or int8 (per-channel); default %(default)s",
    )
    parser.add_argument(
        "--kv-dtype",
        default=EngineConfig.kv_dtype,
        choices=KV_DTYPES,
        help="dtype of the KV cache: auto (float16 under --dtype float32, else --dtype), float16 (twice "
        "the tokens per byte) or float32; default %(default)s",
    )
    parser.add_argument(
        "--attention",
        default=EngineConfig.attention,
        choices=["auto", "native", "torch"],
        help="decode attention: native (a C kernel built on first use, reads the paged cache in place, "
        "bitwise batch-invariant), torch (portable) or auto (native where it can run); default %(default)s",
    )


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        kv_cache_memory=parse_bytes(args.kv_cache_memory),
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_sequences_per_request=args.max_sequences_per_request,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_cache,
        kv_disk=args.kv_disk,
        kv_disk_size=parse_bytes(args.kv_disk_size),
        max_pinned_tokens=args.max_pinned_tokens,
        max_pinned_tokens_per_tenant=args.max_pinned_tokens_per_tenant,
        threads=args.threads,
        device=args.device,
        dtype=args.dtype,
        weight_dtype=args.weight_dtype,
        kv_dtype=args.kv_dtype,
        attention=args.attention,
        **overrides,
    )


def _sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )


def cmd_generate(args: argparse.Namespace) -> int:
    llm = _llm(args)
    for chunk in llm.stream(args.prompt, _params(args)):
        print(chunk, end="", flush=True)
    print()
    return 0


def _llm(args: argparse.Namespace) -> "LLM":
    # Imported here: torch and the model stack load only for the commands that run a model.
    from kvserve.llm import LLM

    return LLM(**asdict(engine_config(args)))


def cache_stats_text(engine: "Engine") -> str:
    """The numbers of the dashboard's JSON (GET /v1/cache/stats), for the terminal: pool, hit rate,
    the heaviest prefixes (as text: it is the user's own chat) and requests."""
    from kvserve.engine.snapshot import take_snapshot
    from kvserve.server.dashboard import StatsHistory, render

    stats = render(
        take_snapshot(engine, max_branches=5), engine.model.name, StatsHistory.empty(), engine.tokenizer
    )
    p, c = stats.pool, stats.counters
    lines = [
        f"pool: {p.blocks} blocks of {p.block_size} tokens: {p.in_use} in use, {p.cached} cached, "
        f"{p.free} free, {p.evicted} evicted",
        f"prefix cache: {100 * c.hit_rate:.1f}% of {c.cache_queries} prompt tokens hit, "
        f"{c.saved_prefill_tokens} prefill tokens saved, {c.prefill_tokens_computed} computed",
    ]
    for b in stats.branches:
        lines.append(f"  {b.tokens:6d} tokens x {b.hits:4d} hits  {b.text!r}")
    return "\n".join(lines)


def cmd_chat(args: argparse.Namespace) -> int:
    """A terminal chat; after each reply: time to first token, decode speed, prompt and cached tokens."""
    from kvserve.model.tokenizer import ChatMessage

    llm = _llm(args)
    messages: list[ChatMessage] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print(
        "kvserve chat: type a message, /reset to start over, /stats for the cache, Ctrl-D to quit.",
        file=sys.stderr,
    )
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line:
            continue
        if line == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if line == "/stats":
            print(cache_stats_text(llm.engine), file=sys.stderr)
            continue
        messages.append({"role": "user", "content": line})
        ids = llm.chat_token_ids(messages)
        start = time.monotonic()
        first = None
        reply = ""
        cached = n_out = 0
        for delta in llm.stream_deltas(ids, _params(args)):
            if first is None:
                first = time.monotonic()
            print(delta.text, end="", flush=True)
            reply += delta.text
            cached, n_out = delta.num_cached_tokens, delta.num_output_tokens
        end = time.monotonic()
        print()
        messages.append({"role": "assistant", "content": reply})
        ttft = (first or end) - start
        rate = (n_out - 1) / (end - first) if first and n_out > 1 and end > first else 0.0
        print(
            f"[ttft {ttft * 1000:.0f} ms | {rate:.1f} tok/s | prompt {len(ids)} tokens, "
            f"{cached} cached | {n_out} generated]",
            file=sys.stderr,
        )


def cmd_serve(args: argparse.Namespace) -> int:
    from kvserve.server.app import serve

    return serve(
        engine_config(args, single_token_threads=args.single_token_threads or None),
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        max_waiting=args.max_waiting,
        dashboard_show_text=args.dashboard_show_text,
        admin_key=args.admin_key,
        served_model_name=args.served_model_name,
        allowed_origins=_origins(args.allowed_origins),
        api_key_file=args.api_key_file,
        max_request_bytes=parse_bytes(args.max_request_bytes),
        max_in_flight_per_tenant=args.max_in_flight_per_tenant,
        tenant_secret_file=args.tenant_secret_file,
        kv_remote=args.kv_remote,
    )


def cmd_cluster(args: argparse.Namespace) -> int:
    from kvserve.cluster.launch import ClusterConfig, run_until_interrupted

    extra = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    return run_until_interrupted(
        ClusterConfig(
            replicas=args.replicas,
            threads=args.threads,
            host=args.host,
            port=args.port,
            policy=args.policy,
            redis=not args.no_redis,
            redis_maxmemory=args.redis_maxmemory,
            tenant_secret_file=args.tenant_secret_file,
            serve_args=extra,
        )
    )


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {number}")
    return number


def _origins(value: str | None) -> list[str]:
    """A JSON list (as vLLM takes it) or a comma-separated list of origins."""
    if not value:
        return []
    if value.lstrip().startswith("["):
        origins = json.loads(value)
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise SystemExit("kvserve: --allowed-origins must be a JSON list of strings")
        return origins
    return [o.strip() for o in value.split(",") if o.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve", description="An LLM server that never prefills the same text twice."
    )
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    _engine_arguments(serve)
    serve.add_argument(
        "--single-token-threads",
        type=int,
        default=1,
        help="threads for a step of one token (one stream decoding alone), leaving the other cores to "
        "HTTP; 0 uses --threads for every step (default %(default)s)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        default=os.environ.get("KVSERVE_API_KEY"),
        help="require this bearer token on every route but /health (default: $KVSERVE_API_KEY, which "
        "unlike an argument does not show in ps)",
    )
    serve.add_argument(
        "--admin-key",
        default=os.environ.get("KVSERVE_ADMIN_KEY"),
        help="bearer token for admin routes (POST /reset_prefix_cache), needed there once keys are set "
        "(default: $KVSERVE_ADMIN_KEY)",
    )
    serve.add_argument(
        "--served-model-name", default=None, help="the model name clients send and see (default: the model's)"
    )
    serve.add_argument(
        "--allowed-origins",
        default=None,
        help="origins browsers may call from (CORS): a JSON list such as '[\"https://a.example\"]' or "
        "a comma-separated list; '*' allows any",
    )
    serve.add_argument("--max-waiting", type=int, default=1024, help="queued requests before answering 503")
    serve.add_argument(
        "--dashboard-show-text",
        action="store_true",
        help="show the first tokens of cached prefixes as text on /dashboard (off: prompts are private)",
    )
    serve.add_argument(
        "--api-key-file",
        default=None,
        help="one 'tenant:key' or 'tenant:key:shared-group' per line; each tenant gets its own prefix-cache "
        "namespace (members of a shared group share one); re-read on SIGHUP",
    )
    serve.add_argument(
        "--max-request-bytes", default="8MiB", help="largest request body, e.g. 8MiB (413 above it)"
    )
    serve.add_argument(
        "--max-in-flight-per-tenant",
        type=int,
        default=256,
        help="requests one tenant may have in flight before answering 429 (default %(default)s)",
    )
    serve.add_argument(
        "--kv-remote",
        default=None,
        metavar="URL",
        help="a Redis server that replicas share as the cache tier below the disk, e.g. "
        "redis://10.0.0.5:6379/0 (needs --tenant-secret-file)",
    )
    serve.add_argument(
        "--tenant-secret-file",
        default=os.environ.get("KVSERVE_TENANT_SECRET_FILE"),
        metavar="FILE",
        help="the server secret (64 hex digits, mode 600) that derives tenants' cache namespaces; give "
        "every replica the same file so that a tenant has one namespace across them (default: "
        "$KVSERVE_TENANT_SECRET_FILE, else one created in the cache folder)",
    )
    serve.set_defaults(func=cmd_serve)

    cluster = sub.add_parser(
        "cluster", help="redis-server, replicas of `kvserve serve` sharing it, and the SMG router, locally"
    )
    cluster.add_argument("--replicas", type=int, default=2)
    cluster.add_argument(
        "--threads", type=int, default=os.cpu_count() or 2, help="torch threads, split between the replicas"
    )
    cluster.add_argument("--host", default="127.0.0.1", help="the router's address")
    cluster.add_argument("--port", type=int, default=8000, help="the router's port")
    cluster.add_argument("--policy", default="cache_aware", help="SMG's routing policy, e.g. round_robin")
    cluster.add_argument("--no-redis", action="store_true", help="replicas without the shared Redis tier")
    cluster.add_argument("--redis-maxmemory", default="1gb", help="Redis' bound (LRU past it)")
    cluster.add_argument(
        "--tenant-secret-file",
        default=os.environ.get("KVSERVE_TENANT_SECRET_FILE"),
        help="the replicas' shared secret (default: a new one in the run folder)",
    )
    cluster.add_argument(
        "serve_args",
        nargs=argparse.REMAINDER,
        help="after --: more `kvserve serve` arguments for every replica",
    )
    cluster.set_defaults(func=cmd_cluster)

    chat = sub.add_parser("chat", help="chat with the model in the terminal")
    _engine_arguments(chat)
    _sampling_arguments(chat)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.set_defaults(func=cmd_chat)

    generate = sub.add_parser("generate", help="complete one prompt and print the text as it streams")
    _engine_arguments(generate)
    _sampling_arguments(generate)
    generate.add_argument("prompt")
    generate.set_defaults(func=cmd_generate)

    try:
        from kvserve.bench.cli import add_bench_arguments, run_bench
    except ImportError:
        pass
    else:
        bench = sub.add_parser("bench", help="benchmark OpenAI-compatible servers on prefix-heavy workloads")
        add_bench_arguments(bench)
        bench.set_defaults(func=run_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from kvserve.errors import KVServeError

    try:
        return int(args.func(args))
    except KVServeError as e:
        print(f"kvserve: {e}", file=sys.stderr)
        return 2
