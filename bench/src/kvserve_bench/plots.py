"""PNG plots of a run, one line (or bar) per target.

Multi-turn workloads are plotted per turn, which is where a prefix cache shows: without it TTFT grows with
the history, with it TTFT stays flat. A single-turn workload has no turns to plot, so its TTFT is shown as
a distribution and its cached fraction as one bar per target.
"""

from collections.abc import Callable, Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from kvserve_bench.report import TargetSummary, TurnSummary
from kvserve_bench.runner import TargetRun


def plot_ttft(title: str, runs: Sequence[TargetRun], summaries: Sequence[TargetSummary], path: Path) -> None:
    fig, ax = _figure()
    if is_multi_turn(summaries):
        _per_turn(ax, summaries, lambda t: t.ttft_p50_s)
        ax.set_ylabel("median time to first token (s)")
    else:
        for run in runs:
            ttfts = sorted(r.ttft_s for r in run.results if r.ttft_s is not None and r.error is None)
            shares = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
            ax.step(ttfts, shares, where="post", label=run.target.name)
        ax.set_xlabel("time to first token (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    _finish(fig, ax, f"{title}: time to first token", path)


def plot_cached_fraction(title: str, summaries: Sequence[TargetSummary], path: Path) -> None:
    fig, ax = _figure()
    if is_multi_turn(summaries):
        _per_turn(ax, summaries, lambda t: t.cached_fraction)
    else:
        colors = [f"C{i}" for i in range(len(summaries))]  # the colors the TTFT plot gives the targets
        ax.bar([s.name for s in summaries], [s.cached_fraction or 0.0 for s in summaries], color=colors)
    ax.set_ylabel("cached / prompt tokens")
    ax.set_ylim(0, 1.05)
    _finish(fig, ax, f"{title}: prompt tokens served from the cache", path)


def plot_latency_per_turn(title: str, summaries: Sequence[TargetSummary], path: Path) -> None:
    """Median inter-token latency and end-to-end time per turn, side by side: what a chat user waits for
    once the first token is there, and for the whole reply."""
    fig = Figure(figsize=(10, 4))
    itl, e2e = fig.subplots(1, 2)
    _per_turn(itl, summaries, lambda t: None if t.itl_p50_s is None else t.itl_p50_s * 1000)
    itl.set_ylabel("median inter-token latency (ms)")
    itl.set_ylim(bottom=0)
    itl.set_title(f"{title}: inter-token latency")
    itl.grid(alpha=0.3)
    _per_turn(e2e, summaries, lambda t: t.e2e_p50_s)
    e2e.set_ylabel("median end-to-end time (s)")
    e2e.set_ylim(bottom=0)
    _finish(fig, e2e, f"{title}: whole reply", path)


def _per_turn(
    ax: Axes, summaries: Sequence[TargetSummary], value: Callable[[TurnSummary], float | None]
) -> None:
    for s in summaries:
        points = [(t.turn, v) for t in s.per_turn if (v := value(t)) is not None]
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=s.name)
    ax.set_xlabel("turn")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def is_multi_turn(summaries: Sequence[TargetSummary]) -> bool:
    return any(len(s.per_turn) > 1 for s in summaries)


def _figure() -> tuple[Figure, Axes]:
    # A bare Figure renders with the Agg canvas and never touches pyplot's global state or a display.
    fig = Figure(figsize=(7, 4))
    return fig, fig.subplots()


def _finish(fig: Figure, ax: Axes, title: str, path: Path) -> None:
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
