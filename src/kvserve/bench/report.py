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

from kvserve.bench.client import RequestResult
from kvserve.bench.runner import TargetRun
from kvserve.bench.workloads import Workload


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
    """One turn across a target's conversations: median TTFT, inter-token latency and end-to-end time,
    and the share of prompt tokens cached."""

    turn: int
    requests: int
    ttft_p50_s: float | None
    cached_fraction: float | None
    itl_p50_s: float | None = None
    e2e_p50_s: float | None = None


@dataclass(frozen=True)
class TargetSummary:
    """A target's numbers for one run. Throughputs divide by `busy_s`, the time the target was driven."""

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


def summarize(run: TargetRun) -> TargetSummary:
    done = [r for r in run.results if r.error is None]
    errors = [r for r in run.results if r.error is not None]
    completion = sum(r.completion_tokens or 0 for r in done)
    cache = run.prefix_cache
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
    )


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
        "settings": {**workload.settings, "max_tokens": workload.max_tokens, "tokenizer": tokenizer},
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


def table_rows(summaries: Sequence[TargetSummary]) -> list[tuple[str, list[str]]]:
    """The rows shared by the terminal and Markdown tables: one metric per row, one target per column."""
    return [
        ("requests (errors)", [f"{s.requests} ({s.errors})" for s in summaries]),
        ("retried (then succeeded)", [f"{s.retried} ({s.recovered})" for s in summaries]),
        ("TTFT p50 / p90 / p99 (ms)", [_ms(s.ttft_s) for s in summaries]),
        ("ITL p50 / p90 / p99 (ms)", [_ms(s.itl_s) for s in summaries]),
        ("E2E p50 / p90 / p99 (s)", [_seconds(s.e2e_s) for s in summaries]),
        ("prompt / cached tokens", [f"{s.prompt_tokens} / {s.cached_tokens}" for s in summaries]),
        ("cached fraction (usage)", [_percent(s.cached_fraction) for s in summaries]),
        ("hit rate (/metrics)", [_percent(s.server_hit_rate) for s in summaries]),
        ("output tokens/s", [_number(s.output_tokens_per_s) for s in summaries]),
        ("requests/s", [_number(s.requests_per_s, 2) for s in summaries]),
    ]


def speedups(summaries: Sequence[TargetSummary]) -> list[str]:
    """How the first target's median TTFT compares with each other target's, as sentences."""
    base = summaries[0].ttft_s.p50 if summaries else None
    if not base:
        return []
    lines = []
    for other in summaries[1:]:
        if other.ttft_s.p50:
            ratio = other.ttft_s.p50 / base
            word = "faster" if ratio >= 1 else "slower"
            lines.append(
                f"TTFT p50: {summaries[0].name} is {max(ratio, 1 / ratio):.2f}x {word} than {other.name}"
            )
    return lines


def rich_table(workload: Workload, summaries: Sequence[TargetSummary]) -> Table:
    table = Table(title=f"{workload.name}: {workload.description}", title_justify="left")
    table.add_column("")
    for s in summaries:
        table.add_column(s.name, justify="right")
    for label, cells in table_rows(summaries):
        table.add_row(label, *cells)
    return table


def markdown(workload: Workload, summaries: Sequence[TargetSummary], image_names: Sequence[str]) -> str:
    """A Markdown section: what ran, the table, the speedups, the plots (linked relative to the file)."""
    lines = [f"### {workload.name}", "", f"{workload.description}.", ""]
    lines.append("| | " + " | ".join(s.name for s in summaries) + " |")
    lines.append("|---|" + "---:|" * len(summaries))
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in table_rows(summaries)]
    lines.append("")
    lines += [f"{line}." for line in speedups(summaries)]
    lines.append("")
    lines += [f"![{name}]({name})" for name in image_names]
    return "\n".join(lines).rstrip() + "\n"


def _ms(d: Distribution) -> str:
    return " / ".join("-" if v is None else f"{v * 1000:.0f}" for v in (d.p50, d.p90, d.p99))


def _seconds(d: Distribution) -> str:
    return " / ".join("-" if v is None else f"{v:.2f}" for v in (d.p50, d.p90, d.p99))


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
