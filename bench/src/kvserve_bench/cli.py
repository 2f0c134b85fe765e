"""`kvserve bench`: run a workload against OpenAI-compatible targets, or compare kvserve with its cache off.

kvserve bench multiturn --target cache=http://127.0.0.1:8000 --target peer=http://127.0.0.1:8001
kvserve bench shared-prefix --target http://127.0.0.1:8000 --request-rate 4
kvserve bench sharegpt --target http://127.0.0.1:8000 --conversations 8
kvserve bench repeat --target spec=http://127.0.0.1:8000 --target off=http://127.0.0.1:8001
kvserve bench compare --out benchmarks/results
"""

import argparse
import asyncio
import dataclasses
import logging
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvserve.config import EngineConfig
from kvserve.flags import add_flags, from_flags, to_argv
from kvserve_bench import workloads
from kvserve_bench.client import Target, connect, parse_target
from kvserve_bench.errors import BenchError
from kvserve_bench.loops import mark_greedy_loops
from kvserve_bench.plots import is_multi_turn, plot_cached_fraction, plot_latency_per_turn, plot_ttft
from kvserve_bench.report import TargetSummary, markdown, report_data, rich_table, summarize, write_json
from kvserve_bench.runner import run_workload
from kvserve_bench.servers import local_servers
from kvserve_bench.sharegpt import iter_dataset
from kvserve_bench.tokens import TokenCounter, choose_tokenizer, text_only
from kvserve_bench.workloads import (
    AgentLoopSpec,
    CodeEditSpec,
    MultiturnSpec,
    RepeatSpec,
    SharedPrefixSpec,
    SharegptSpec,
    Workload,
)

# The headline comparison of `make bench`: sized to take a few minutes on 2 CPU cores with the 135M model.
COMPARE_MULTITURN = MultiturnSpec(
    conversations=4, turns=6, system_tokens=1000, user_tokens=40, reply_tokens=32, max_in_flight=4
)
COMPARE_SHARED_PREFIX = SharedPrefixSpec(
    groups=2, prompts_per_group=8, system_tokens=1000, question_tokens=50, output_tokens=16
)
COMPARE_TARGETS = (("prefix-cache", ()), ("no-prefix-cache", ("--no-prefix-cache",)))
COMPARE_SERVER_FLAGS = ("model", "kv_cache_memory")

WorkloadBuilder = Callable[[TokenCounter], Workload]


@dataclass(frozen=True)
class _Outcome:
    workload: Workload
    summaries: list[TargetSummary]
    markdown: str


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_workload", required=True, metavar="WORKLOAD")

    m = _workload_parser(sub, "multiturn", "conversations whose full history is resent every turn")
    add_flags(m, MultiturnSpec)
    p = _workload_parser(
        sub, "shared-prefix", "groups of prompts that share a system prompt (SGLang's shape)"
    )
    add_flags(p, SharedPrefixSpec)
    g = _workload_parser(sub, "sharegpt", "real conversations from ShareGPT, replayed turn by turn")
    add_flags(g, SharegptSpec)
    r = _workload_parser(
        sub, "repeat", "a list, then the same answer again: turn 2 copies turn 1 (speculation's best case)"
    )
    add_flags(r, RepeatSpec)
    e = _workload_parser(
        sub, "code-edit", "a source file in the prompt, asked back with one function renamed"
    )
    add_flags(e, CodeEditSpec)
    a = _workload_parser(sub, "agent-loop", "an agent's tool results in the history, each turn quoting one")
    add_flags(a, AgentLoopSpec)

    c = sub.add_parser(
        "compare",
        help="start kvserve with and without its prefix cache and run the headline workloads on both",
        description="Starts two local kvserve servers (prefix cache on, and --no-prefix-cache), runs "
        "multiturn and shared-prefix on both, interleaved, writes JSON, PNG plots and README-table.md, "
        "and stops them. --model and --kv-cache-memory are passed to both servers.",
    )
    c.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    add_flags(c, MultiturnSpec, ["seed"])
    add_flags(c, EngineConfig, COMPARE_SERVER_FLAGS)
    c.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for /health")
    _common_run_arguments(c)


def run_bench(args: argparse.Namespace) -> int:
    # One INFO line per HTTP request would bury the progress bar and the table.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        if args.bench_workload == "compare":
            return _compare(args)
        return _run_workload_command(args)
    except BenchError as e:
        print(f"kvserve bench: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvserve bench: interrupted", file=sys.stderr)
        return 130


def _workload_parser(
    sub: "argparse._SubParsersAction[argparse.ArgumentParser]", name: str, about: str
) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=about, description=about)
    p.add_argument(
        "--target",
        action="append",
        required=True,
        metavar="NAME=URL",
        help="an OpenAI-compatible server; repeat to run several side by side (ratios are to the first)",
    )
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for JSON, plots, Markdown")
    p.add_argument("--model", help="model name to request (default: the first of the target's /v1/models)")
    _common_run_arguments(p)
    return p


def _common_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--retries",
        type=int,
        default=0,
        help="send a request that failed on a connection error, a 5xx or a broken stream again, up to "
        "this many times (1: retry once, as a client of a replicated cluster does); counted in the report",
    )


def _builder(args: argparse.Namespace) -> WorkloadBuilder:
    name: str = args.bench_workload
    if name == "multiturn":
        multiturn = from_flags(MultiturnSpec, args)
        return lambda count: workloads.multiturn(multiturn, count)
    if name == "shared-prefix":
        prefix = from_flags(SharedPrefixSpec, args)
        return lambda count: workloads.shared_prefix(prefix, count)
    if name == "repeat":
        repeat = from_flags(RepeatSpec, args)
        return lambda count: workloads.repeat(repeat)
    if name == "code-edit":
        edit = from_flags(CodeEditSpec, args)
        return lambda count: workloads.code_edit(edit)
    if name == "agent-loop":
        agent = from_flags(AgentLoopSpec, args)
        return lambda count: workloads.agent_loop(agent)
    sharegpt = from_flags(SharegptSpec, args)
    return lambda count: workloads.sharegpt(sharegpt, count, iter_dataset())


def _run_workload_command(args: argparse.Namespace) -> int:
    targets = [parse_target(spec) for spec in args.target]
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise BenchError(f"target names must differ: {', '.join(names)}")
    outcome = _run(_builder(args), targets, args, args.model)
    (args.out / f"{outcome.workload.name}.md").write_text(outcome.markdown)
    return _exit_code([outcome])


def _compare(args: argparse.Namespace) -> int:
    server_flags = to_argv(EngineConfig, args, COMPARE_SERVER_FLAGS)
    flag_sets = [[*server_flags, *flags] for _, flags in COMPARE_TARGETS]
    with local_servers(flag_sets, args.startup_timeout) as urls:
        targets = [Target(name, url) for (name, _), url in zip(COMPARE_TARGETS, urls, strict=True)]
        multiturn = dataclasses.replace(COMPARE_MULTITURN, seed=args.seed)
        prefix = dataclasses.replace(COMPARE_SHARED_PREFIX, seed=args.seed)
        outcomes = [
            _run(lambda count: workloads.multiturn(multiturn, count), targets, args, None),
            _run(lambda count: workloads.shared_prefix(prefix, count), targets, args, None),
        ]
    model = outcomes[0].summaries[0].model
    header = (
        "## Prefix cache on vs off\n\n"
        f"`make bench` on {datetime.now(UTC):%Y-%m-%d}: two kvserve servers with model `{model}` on "
        f"{_cpus()}, one with the prefix cache (`prefix-cache`) and one started with `--no-prefix-cache`. "
        "The bench drives them in interleaved steps, one server at a time, so both see the same machine.\n"
    )
    (args.out / "README-table.md").write_text("\n".join([header, *(o.markdown for o in outcomes)]))
    return _exit_code(outcomes)


def _run(
    build: WorkloadBuilder, unconnected: Sequence[Target], args: argparse.Namespace, model: str | None
) -> _Outcome:
    with httpx.Client(timeout=30.0) as client:
        targets = [connect(client, t, model) for t in unconnected]
        token_ids, tokenizer = choose_tokenizer(client, targets)
        workload = build(text_only(lambda text: len(token_ids(text))))
        started_at = datetime.now(UTC).isoformat(timespec="seconds")
        total = workload.num_requests * len(targets)
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            disable=args.no_progress,
            transient=True,
        ) as progress:
            task = progress.add_task(f"{workload.name} requests", total=total)
            runs = asyncio.run(
                run_workload(
                    workload,
                    targets,
                    args.seed,
                    args.request_timeout,
                    lambda n: progress.advance(task, n),
                    retries=args.retries,
                )
            )
        # After the run, so that tokenizing the replies takes none of the servers' measured time.
        mark_greedy_loops((r for run in runs for r in run.results), token_ids)
    summaries = [summarize(run) for run in runs]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{workload.name}.json", report_data(workload, runs, summaries, tokenizer, started_at))
    images = [f"{workload.name}-ttft.png", f"{workload.name}-cached.png"]
    plot_ttft(workload.name, runs, summaries, out / images[0])
    plot_cached_fraction(workload.name, summaries, out / images[1])
    if is_multi_turn(summaries):
        images.append(f"{workload.name}-latency.png")
        plot_latency_per_turn(workload.name, summaries, out / images[2])
    Console().print(rich_table(workload, summaries))
    return _Outcome(workload, summaries, markdown(workload, summaries, images))


def _exit_code(outcomes: Sequence[_Outcome]) -> int:
    failed = [(o.workload.name, s) for o in outcomes for s in o.summaries if s.errors]
    for workload, s in failed:
        message = f"{s.errors} of {s.requests} {workload} requests failed on {s.name}: {s.first_error}"
        print(f"kvserve bench: {message}", file=sys.stderr)
    return 1 if failed else 0


def _cpus() -> str:
    return f"{os.cpu_count()} CPU cores ({platform.machine()})"
