"""From request results to what a person reads: per-target summaries, the JSON file, the tables."""

import dataclasses
import json
import math
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from kvserve_bench.client import RequestResult
from kvserve_bench.metrics_scrape import SpeculationDelta
from kvserve_bench.runner import TargetRun
from kvserve_bench.workloads import Workload


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0 to 100), interpolating linearly between ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Distribution:
    p50: float | None
    p90: float | None
    p99: float | None
    mean: float | None

    @staticmethod
    def of(values: Sequence[float]) -> "Distribution":
        mean = sum(values) / len(values) if values else None
        return Distribution(percentile(values, 50), percentile(values, 90), percentile(values, 99), mean)


@dataclass(frozen=True)
class TurnSummary:
    """One turn across a target's conversations: median TTFT, inter-token latency, time per output token
    and end-to-end time, and the share of prompt tokens cached."""

    turn: int
    requests: int
    ttft_p50_s: float | None
    cached_fraction: float | None
    itl_p50_s: float | None = None
    e2e_p50_s: float | None = None
    tpot_p50_s: float | None = None


@dataclass(frozen=True)
class TargetSummary:
    """A target's numbers for one run. Throughputs divide by `busy_s`, the time the target was driven.

    `tpot_s` is per request: (end to end - TTFT) / (output tokens - 1). Speculation comes from the
    server's counters over the run (`speculation_source` "/metrics") or, where it has none, from the
    requests' own reports ("timings", llama-server's, which count no drafts); None: nothing reported.
    `greedy_loops` counts the replies that end in a loop (bench/loops.py) of the `loops_checked` ones.
    """

    name: str
    url: str
    model: str
    requests: int
    errors: int
    first_error: str | None
    # Requests sent again after a failure (`--retries`), and of those, how many then succeeded.
    retried: int
    recovered: int
    ttft_s: Distribution
    itl_s: Distribution
    e2e_s: Distribution
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_fraction: float | None
    server_prefix_cache_queries: float | None
    server_prefix_cache_hits: float | None
    server_hit_rate: float | None
    busy_s: float
    requests_per_s: float | None
    output_tokens_per_s: float | None
    per_turn: list[TurnSummary]
    tpot_s: Distribution
    speculation_source: str | None
    spec_drafts: float | None
    spec_draft_tokens: float | None
    spec_accepted_tokens: float | None
    acceptance_rate: float | None
    mean_accepted_length: float | None
    greedy_loops: int
    loops_checked: int


def summarize(run: TargetRun) -> TargetSummary:
    done = [r for r in run.results if r.error is None]
    errors = [r for r in run.results if r.error is not None]
    completion = sum(r.completion_tokens or 0 for r in done)
    cache = run.prefix_cache
    speculation, source = speculation_of(run, done)
    return TargetSummary(
        name=run.target.name,
        url=run.target.url,
        model=run.target.model,
        requests=len(run.results),
        errors=len(errors),
        first_error=errors[0].error if errors else None,
        retried=sum(1 for r in run.results if r.retries),
        recovered=sum(1 for r in done if r.retries),
        ttft_s=Distribution.of([r.ttft_s for r in done if r.ttft_s is not None]),
        itl_s=Distribution.of([gap for r in done for gap in r.itl_s]),
        e2e_s=Distribution.of([r.e2e_s for r in done]),
        prompt_tokens=sum(r.prompt_tokens or 0 for r in done),
        completion_tokens=completion,
        cached_tokens=sum(r.cached_tokens or 0 for r in done),
        cached_fraction=cached_fraction(done),
        server_prefix_cache_queries=None if cache is None else cache.queries,
        server_prefix_cache_hits=None if cache is None else cache.hits,
        server_hit_rate=None if cache is None else cache.hit_rate,
        busy_s=run.busy_s,
        requests_per_s=len(done) / run.busy_s if run.busy_s else None,
        output_tokens_per_s=completion / run.busy_s if run.busy_s else None,
        per_turn=per_turn(done),
        tpot_s=Distribution.of(tpots(done)),
        speculation_source=source,
        spec_drafts=None if speculation is None else speculation.drafts,
        spec_draft_tokens=None if speculation is None else speculation.draft_tokens,
        spec_accepted_tokens=None if speculation is None else speculation.accepted_tokens,
        acceptance_rate=None if speculation is None else speculation.acceptance_rate,
        mean_accepted_length=None if speculation is None else speculation.mean_accepted_length,
        greedy_loops=sum(1 for r in done if r.greedy_loop),
        loops_checked=sum(1 for r in done if r.greedy_loop is not None),
    )


def speculation_of(
    run: TargetRun, done: Sequence[RequestResult]
) -> tuple[SpeculationDelta | None, str | None]:
    """The server's speculation over the run and where it was read: its counters, else its requests'."""
    if run.speculation is not None:
        return run.speculation, "/metrics"
    reported = [r for r in done if r.draft_tokens is not None]
    if not reported:
        return None, None
    drafted = sum(r.draft_tokens or 0 for r in reported)
    return SpeculationDelta(None, drafted, sum(r.accepted_tokens or 0 for r in reported)), "timings"


def tpots(results: Sequence[RequestResult]) -> list[float]:
    return [t for r in results if (t := r.tpot_s) is not None]


def cached_fraction(results: Sequence[RequestResult]) -> float | None:
    """Cached over prompt tokens, from the requests whose usage reported both; None if none did."""
    reported = [r for r in results if r.cached_tokens is not None and r.prompt_tokens]
    if not reported:
        return None
    return sum(r.cached_tokens or 0 for r in reported) / sum(r.prompt_tokens or 0 for r in reported)


def per_turn(results: Sequence[RequestResult]) -> list[TurnSummary]:
    turns = sorted({r.turn for r in results})
    summaries = []
    for turn in turns:
        at_turn = [r for r in results if r.turn == turn]
        ttfts = [r.ttft_s for r in at_turn if r.ttft_s is not None]
        summaries.append(
            TurnSummary(
                turn,
                len(at_turn),
                percentile(ttfts, 50),
                cached_fraction(at_turn),
                itl_p50_s=percentile([gap for r in at_turn for gap in r.itl_s], 50),
                e2e_p50_s=percentile([r.e2e_s for r in at_turn], 50),
                tpot_p50_s=percentile(tpots(at_turn), 50),
            )
        )
    return summaries


def report_data(
    workload: Workload,
    runs: Sequence[TargetRun],
    summaries: Sequence[TargetSummary],
    tokenizer: str,
    started_at: str,
) -> dict[str, Any]:
    """Everything about a run, for the JSON file: settings, each target's summary, every request."""
    return {
        "workload": workload.name,
        "description": workload.description,
        "settings": {
            **workload.settings,
            "max_tokens": workload.max_tokens,
            "ignore_eos": workload.ignore_eos,
            "figure": workload.figure,
            "figure_turn": workload.figure_turn,
            "tokenizer": tokenizer,
        },
        "started_at": started_at,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "targets": [dataclasses.asdict(s) for s in summaries],
        "requests": [
            dataclasses.asdict(r) for run in runs for r in sorted(run.results, key=lambda r: r.start_s)
        ],
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Writes through a temporary file, so that an interrupted run never leaves half a report."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def table_rows(workload: Workload, summaries: Sequence[TargetSummary]) -> list[tuple[str, list[str]]]:
    """The rows shared by the terminal and Markdown tables: one metric per row, one target per column."""
    rows = [
        ("requests (errors)", [f"{s.requests} ({s.errors})" for s in summaries]),
        ("retried (then succeeded)", [f"{s.retried} ({s.recovered})" for s in summaries]),
        ("TTFT p50 / p90 / p99 (ms)", [_ms(s.ttft_s) for s in summaries]),
        ("ITL p50 / p90 / p99 (ms)", [_ms(s.itl_s) for s in summaries]),
        ("TPOT p50 / p90 / p99 (ms)", [_ms(s.tpot_s, 1) for s in summaries]),
    ]
    if workload.figure_turn is not None:
        label = f"TPOT p50, turn {workload.figure_turn} (ms)"
        rows.append((label, [_ms_value(figure_value(workload, s)) for s in summaries]))
    return [
        *rows,
        ("E2E p50 / p90 / p99 (s)", [_seconds(s.e2e_s) for s in summaries]),
        ("prompt / cached tokens", [f"{s.prompt_tokens} / {s.cached_tokens}" for s in summaries]),
        ("cached fraction (usage)", [_percent(s.cached_fraction) for s in summaries]),
        ("hit rate (/metrics)", [_percent(s.server_hit_rate) for s in summaries]),
        ("output tokens/s", [_number(s.output_tokens_per_s) for s in summaries]),
        ("requests/s", [_number(s.requests_per_s, 2) for s in summaries]),
        ("draft tokens accepted", [acceptance_cell(s) for s in summaries]),
        ("accepted tokens per draft", [accepted_length_cell(s) for s in summaries]),
        ("replies ending in a loop", [loops_cell(s) for s in summaries]),
    ]


def figure_value(workload: Workload, summary: TargetSummary) -> float | None:
    """The workload's figure for one target: median TTFT, or median time per output token (of
    `figure_turn` only, where the workload names one)."""
    if workload.figure == "ttft":
        return summary.ttft_s.p50
    if workload.figure_turn is None:
        return summary.tpot_s.p50
    return next((t.tpot_p50_s for t in summary.per_turn if t.turn == workload.figure_turn), None)


def figure_name(workload: Workload) -> str:
    if workload.figure == "ttft":
        return "TTFT p50"
    return "TPOT p50" + ("" if workload.figure_turn is None else f", turn {workload.figure_turn}")


def speedups(workload: Workload, summaries: Sequence[TargetSummary]) -> list[str]:
    """How the first target's figure (median TTFT, or time per output token) compares with each other
    target's, as sentences."""
    base = figure_value(workload, summaries[0]) if summaries else None
    if not base:
        return []
    lines = []
    for other in summaries[1:]:
        value = figure_value(workload, other)
        if value:
            ratio = value / base
            word = "faster" if ratio >= 1 else "slower"
            lines.append(
                f"{figure_name(workload)}: {summaries[0].name} is {max(ratio, 1 / ratio):.2f}x {word} "
                f"than {other.name}"
            )
    return lines


def acceptance_cell(s: TargetSummary) -> str:
    """ "n/a" where the server reports no speculation, "none drafted" where it drafted nothing."""
    if s.spec_draft_tokens is None:
        return "n/a"
    if s.acceptance_rate is None:
        return "none drafted"
    return f"{s.acceptance_rate:.1%} ({s.spec_accepted_tokens:.0f} / {s.spec_draft_tokens:.0f})"


def accepted_length_cell(s: TargetSummary) -> str:
    return "n/a" if s.mean_accepted_length is None else f"{s.mean_accepted_length:.2f}"


def loops_cell(s: TargetSummary) -> str:
    return "-" if not s.loops_checked else f"{s.greedy_loops} of {s.loops_checked}"


def rich_table(workload: Workload, summaries: Sequence[TargetSummary]) -> Table:
    table = Table(title=f"{workload.name}: {workload.description}", title_justify="left")
    table.add_column("")
    for s in summaries:
        table.add_column(s.name, justify="right")
    for label, cells in table_rows(workload, summaries):
        table.add_row(label, *cells)
    return table


def markdown(workload: Workload, summaries: Sequence[TargetSummary], image_names: Sequence[str]) -> str:
    """A Markdown section: what ran, the table, the speedups, the plots (linked relative to the file)."""
    lines = [f"### {workload.name}", "", f"{workload.description}.", ""]
    lines.append("| | " + " | ".join(s.name for s in summaries) + " |")
    lines.append("|---|" + "---:|" * len(summaries))
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in table_rows(workload, summaries)]
    lines.append("")
    lines += [f"{line}." for line in speedups(workload, summaries)]
    lines.append("")
    lines += [f"![{name}]({name})" for name in image_names]
    return "\n".join(lines).rstrip() + "\n"


def _ms(d: Distribution, digits: int = 0) -> str:
    return " / ".join("-" if v is None else f"{v * 1000:.{digits}f}" for v in (d.p50, d.p90, d.p99))


def _seconds(d: Distribution) -> str:
    return " / ".join("-" if v is None else f"{v:.2f}" for v in (d.p50, d.p90, d.p99))


def _ms_value(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
