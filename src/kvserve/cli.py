"""kvserve command line: serve | chat | generate | bench."""

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from kvserve.config import EngineConfig
from kvserve.credentials import take_launch_nonce
from kvserve.errors import KVServeError
from kvserve.flags import add_flags, from_flags
from kvserve.options import ServerOptions

if TYPE_CHECKING:
    from kvserve.cache.cache_miss import CacheMiss
    from kvserve.engine.engine import Engine
    from kvserve.engine.sampling_params import SamplingParams
    from kvserve.llm import LLM


# Engine flags that only the server has: a terminal chat neither queues nor shares its cores.
_SERVER_ENGINE_FLAGS = ("single_token_threads", "max_waiting")


def _engine_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, EngineConfig, exclude=_SERVER_ENGINE_FLAGS)


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    return from_flags(EngineConfig, args, **overrides)


def _sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)


def _params(args: argparse.Namespace) -> "SamplingParams":
    from kvserve.engine.sampling_params import SamplingParams

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


# The first tokens of a hot prefix that /stats shows: enough to tell a system prompt or a turn apart.
_HEAD_TOKENS = 12


def cache_stats_text(engine: "Engine") -> str:
    """The engine's snapshot (engine/snapshot.py) for the terminal: the pool by state, the prefix
    cache's hit rate, speculation's acceptance once something was drafted, and the heaviest hit
    prefixes, as text (it is the user's own chat)."""
    from kvserve.engine.snapshot import take_snapshot

    snapshot = take_snapshot(engine, max_branches=5)
    stats, pool = snapshot.stats, snapshot.stats.cache
    lines = [
        f"pool: {pool.num_blocks} blocks of {snapshot.block_size} tokens: {pool.num_locked} in use, "
        f"{pool.num_evictable} cached, {pool.num_free} free, {pool.num_evicted} evicted",
        f"prefix cache: {100 * stats.hit_rate:.1f}% of {stats.cache_queries} prompt tokens hit, "
        f"{stats.cache_hits} prefill tokens saved, {stats.prefill_tokens_computed} computed",
    ]
    rate, length = stats.spec_acceptance_rate, stats.spec_mean_accepted_length
    if rate is not None and length is not None:
        lines.append(
            f"speculation: {stats.spec_accepted_tokens} of {stats.spec_draft_tokens} draft tokens accepted "
            f"({100 * rate:.1f}%), {length:.2f} per draft over {stats.spec_drafts} drafts"
        )
    if stats.step_costs is not None:
        costs = stats.step_costs
        lines.append(
            f"step cost: {1000 * costs.fixed:.1f} ms fixed, {1000 * costs.decode:.1f} ms a decode row, "
            f"{1000 * costs.draft:.1f} ms a draft row ({costs.draft / costs.fixed:.2f} of the fixed part)"
        )
    for b in snapshot.branches:
        head = engine.tokenizer.decode(list(b.head[:_HEAD_TOKENS]))
        lines.append(f"  {b.num_tokens:6d} tokens x {b.hits:4d} hits  {head!r}")
    return "\n".join(lines)


def miss_text(miss: "CacheMiss | None") -> str:
    """/stats' line on the last reply's prompt: why it computed again text the chat had seen, if it did
    (cache/cache_miss.py)."""
    if miss is None:
        return "last miss: none (the last prompt found all of itself the chat had computed)"
    where = f" at token {miss.position}" if miss.reason == "diverged" else ""
    return (
        f"last miss: {miss.reason}{where}, {miss.missed_tokens} tokens computed again "
        f"({miss.cached_tokens} cached)"
    )


def cmd_chat(args: argparse.Namespace) -> int:
    """A terminal chat; after each reply: time to first token, decode speed, prompt and cached tokens."""
    from kvserve.model.tokenizer import MessageDict

    llm = _llm(args)
    messages: list[MessageDict] = []
    last_miss: CacheMiss | None = None
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
            print(miss_text(last_miss), file=sys.stderr)
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
            last_miss = delta.cache_miss
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
    # The options first: a bad one is refused before the server's imports (torch among them) load.
    config = engine_config(args)
    options = from_flags(ServerOptions, args, launch_nonce=take_launch_nonce())
    from kvserve.server.app import serve

    return serve(config, options)


def cmd_cluster(args: argparse.Namespace) -> int:
    extra = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    from kvserve.cluster.launch import ClusterConfig, run_until_interrupted

    return run_until_interrupted(from_flags(ClusterConfig, args, serve_args=extra))


# The commands whose parser leaves out the cluster's flags.
_NOT_CLUSTER = ("serve", "chat", "generate", "bench")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; given the `command` that argv names, a parser for it that leaves out
    the bench's arguments unless it is the bench, so that `serve` never imports the bench's plotting
    and terminal libraries (about 30 MiB resident for the server's lifetime)."""
    parser = argparse.ArgumentParser(
        prog="kvserve", description="An LLM server that never prefills the same text twice."
    )
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    _engine_arguments(serve)
    add_flags(serve, EngineConfig, _SERVER_ENGINE_FLAGS)
    add_flags(serve, ServerOptions)
    serve.set_defaults(func=cmd_serve)

    cluster = sub.add_parser(
        "cluster", help="redis-server, replicas of `kvserve serve` sharing it, and the SMG router, locally"
    )
    if command not in _NOT_CLUSTER:
        # Its flags' module loads the HTTP client and Redis's process control (a quarter of a second),
        # which no other command needs.
        from kvserve.cluster.launch import ClusterConfig

        add_flags(cluster, ClusterConfig)
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

    if command in sub.choices:
        return parser
    try:
        from kvserve_bench.cli import add_bench_arguments, run_bench
    except ModuleNotFoundError:
        pass  # the benchmark is not installed: `main` says how to install it when asked for
    else:
        bench = sub.add_parser("bench", help="benchmark OpenAI-compatible servers on prefix-heavy workloads")
        add_bench_arguments(bench)
        bench.set_defaults(func=run_bench)
    return parser


def named_command(argv: Sequence[str]) -> str | None:
    """The subcommand argv names: its first word after the top-level option; None when it names none."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def bench_not_installed() -> str | None:
    """Why `kvserve bench` cannot run here, and how to install it; None when it can. The benchmark is a
    package of its own (bench/), so that serving installs no plotting or progress-bar libraries."""
    try:
        import kvserve_bench.cli  # noqa: F401
    except ModuleNotFoundError as e:
        return f"kvserve bench is not installed ({e}): pip install -e ./bench in a kvserve checkout"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = named_command(argv)
    if command == "bench" and (missing := bench_not_installed()) is not None:
        print(f"kvserve: error: {missing}", file=sys.stderr)
        return 2
    args = build_parser(command).parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args))
    except KVServeError as e:
        # One line, as argparse reports a usage error: what is wrong and which option to change.
        print(f"kvserve: error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2
