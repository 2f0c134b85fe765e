"""PNG plots of a run, one line (or bar) per target.

Multi-turn workloads are plotted per turn, which is where a prefix cache shows: without it TTFT grows with
the history, with it TTFT stays flat. A single-turn workload has no turns to plot, so its TTFT is shown as
a distribution and its cached fraction as one bar per target.
"""

from collections.abc import Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from kvserve.bench.report import TargetSummary
from kvserve.bench.runner import TargetRun


def plot_ttft(title: str, runs: Sequence[TargetRun], summaries: Sequence[TargetSummary], path: Path) -> None:
    fig, ax = _figure()
    if _multi_turn(summaries):
        for s in summaries:
            points = [(t.turn, t.ttft_p50_s) for t in s.per_turn if t.ttft_p50_s is not None]
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=s.name)
        ax.set_xlabel("turn")
        ax.set_ylabel("median time to first token (s)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
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
    if _multi_turn(summaries):
        for s in summaries:
            points = [(t.turn, t.cached_fraction) for t in s.per_turn if t.cached_fraction is not None]
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=s.name)
        ax.set_xlabel("turn")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        colors = [f"C{i}" for i in range(len(summaries))]  # the colors the TTFT plot gives the targets
        ax.bar([s.name for s in summaries], [s.cached_fraction or 0.0 for s in summaries], color=colors)
    ax.set_ylabel("cached / prompt tokens")
    ax.set_ylim(0, 1.05)
    _finish(fig, ax, f"{title}: prompt tokens served from the cache", path)


def _multi_turn(summaries: Sequence[TargetSummary]) -> bool:
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
