"""What a step costs on this machine and model: a fixed part plus a cost per row of each kind.

A step of D decode rows, R draft rows and P prefill tokens takes about
    fixed + D * decode + R * draft + P * prefill
seconds near a given load. `StepCostEstimator` fits the four figures by exponentially weighted least
squares over the steps it is shown (the startup probe's, engine/cost_probe.py, then every step served),
so that they follow the machine's load and the model; `LoadCostEstimator` keeps one such fit over every
step and one per load bucket, as the line is not the same at one sequence and at eight; the drafter reads
them (`LoadCosts.row_share`) instead of a constant.

Timing values are input: a step time may be NaN, zero, negative or huge (a clock jump, a process
paused), and counts may be anything. Nothing here raises for them: a time outside [MIN_STEP_S,
MAX_STEP_S] is clamped, one far from the fit is cut back to a few deviations of it (Huber), and the fit
is pulled toward the anchor (the probe's figures) so that a kind of row the steps stop showing keeps its
last estimate instead of drifting, and every figure is clamped to a finite positive range. A draft row is
pulled toward the decode row's cost instead: it is the same computation (a row through every layer and
its logits), and steps without drafts never correct a draft figure, so a probe that misjudged it (a
busy machine) would otherwise keep the drafter off for good.
"""

import bisect
import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

KINDS = ("fixed", "decode", "draft", "prefill")
# Step times outside this range are clamped before they are fitted.
MIN_STEP_S = 1e-6
MAX_STEP_S = 600.0
# A row costs at least this share of the fixed part and at most this many fixed parts: a row is never
# free (the drafter would draft anything), and never so dear that one noisy fit stops drafting for good.
MIN_ROW_SHARE = 1e-3
MAX_ROW_SHARE = 1e3
# A step's fixed part is at least this share of a lone decode's step.
MIN_FIXED_SHARE = 0.1
# Counts beyond this are clamped (a step never holds more rows).
MAX_ROWS = 1 << 20
# The weight of each past step falls by DECAY per step: the fit reflects about the last 200 steps.
DECAY = 0.995
# How much the anchor weighs, as steps of typical counts (one fixed part, 4 decode rows, 4 draft rows,
# 256 prefill tokens each): next to the fit's 200 steps, a tie-breaker for kinds the steps do not show.
ANCHOR_STEPS = 0.5
_TYPICAL = np.array([1.0, 4.0, 4.0, 256.0])
_DRAFT_LESS_DECODE = np.array([0.0, -1.0, 1.0, 0.0])
# A step time further than HUBER deviations from the fit counts as if it were HUBER deviations away
# (relative deviations: the mean of |time / predicted - 1|, at least MIN_DEVIATION as timers are not exact).
HUBER = 4.0
MIN_DEVIATION = 0.05
# The deviation follows the last 20 steps or so: a lasting change (another job on the cores) widens it
# soon, and the fit then follows, where a lone outlier hardly moves it.
DEVIATION_DECAY = 0.95
MAX_ERROR = 1.0
# The loads (sequences decoding in a step) whose steps are also fitted apart, a step going to the last
# bucket at or below its load (LoadCostEstimator), and how many steps a bucket sees before it answers
# for its loads rather than the fit over every step.
LOAD_BUCKETS = (1, 2, 4, 8)
MIN_BUCKET_STEPS = 32


@dataclass(frozen=True)
class StepCosts:
    """Seconds: a step's fixed part, and what each decode row, draft row and prefill token adds."""

    fixed: float
    decode: float
    draft: float
    prefill: float

    @classmethod
    def relative(cls, row_cost: float, fixed: float = 1.0) -> "StepCosts":
        """Every row `row_cost` fixed parts (a prefill token half that: it computes no logits)."""
        row = row_cost * fixed
        return cls(fixed, row, row, row / 2)

    def time(self, decodes: int, drafts: int, prefill: int) -> float:
        return self.fixed + decodes * self.decode + drafts * self.draft + prefill * self.prefill

    def row_share(self, load: int) -> float:
        """What one more draft row costs in a step of `load` rows, as a share of what one sequence's token
        costs there: one sequence's token costs (fixed + load * decode) / load, so an accepted draft token
        pays for its row while its chance exceeds load * draft / (fixed + load * decode)."""
        rows = min(max(load, 1), MAX_ROWS)
        return rows * self.draft / (self.fixed + rows * self.decode)

    def as_vector(self) -> npt.NDArray[np.float64]:
        return np.array([self.fixed, self.decode, self.draft, self.prefill])

    @classmethod
    def clamped(cls, values: npt.NDArray[np.floating[Any]] | list[float]) -> "StepCosts":
        """Figures within their bounds; a non-finite one takes its bound. A fixed part below MIN_FIXED_SHARE
        of a lone decode's step (a noisy fit can give one below zero) is raised to it, out of the decode
        row's cost, so that the lone decode's time, the best-measured figure, stays as fitted."""
        values = [float(v) for v in values]
        lone = values[0] + values[1]
        if math.isfinite(lone) and lone > 0 and values[0] < MIN_FIXED_SHARE * lone:
            values[0:2] = [MIN_FIXED_SHARE * lone, (1 - MIN_FIXED_SHARE) * lone]
        fixed = _clamp(float(values[0]), MIN_STEP_S, MAX_STEP_S, MIN_STEP_S)
        rows = [
            _clamp(float(v), MIN_ROW_SHARE * fixed, MAX_ROW_SHARE * fixed, MIN_ROW_SHARE * fixed)
            for v in values[1:]
        ]
        return cls(fixed, *rows)


def _clamp(value: float, low: float, high: float, nan: float) -> float:
    if math.isnan(value):
        return nan
    return min(max(value, low), high)


def _count(value: int) -> float:
    return float(min(max(int(value), 0), MAX_ROWS))


class StepCostEstimator:
    """An exponentially weighted least-squares fit of step time against the rows of each kind, pulled
    toward an anchor: `anchor`'s figures once given (the probe's), before that rows of `row_cost` fixed
    parts, scaled to the first step seen. `costs` is always finite and within StepCosts.clamped's bounds."""

    def __init__(self, row_cost: float) -> None:
        self._anchor = StepCosts.clamped(StepCosts.relative(row_cost).as_vector())
        self._scaled = False
        self._gram = np.zeros((4, 4))
        self._moment = np.zeros(4)
        # The weighted mean absolute relative deviation from the fit; None before the first step.
        self._deviation: float | None = None
        self.steps = 0
        self.costs = self._anchor

    def anchor(self, costs: StepCosts) -> None:
        """Pull the fit toward `costs` from now on (the probe's figures)."""
        self._anchor = StepCosts.clamped(costs.as_vector())
        self._scaled = True
        self._refit()

    def observe(self, decodes: int, drafts: int, prefill: int, seconds: float) -> None:
        """A step of `decodes` decode rows, `drafts` draft rows and `prefill` prefill tokens took
        `seconds`. Never raises for any values."""
        x = np.array([1.0, _count(decodes), _count(drafts), _count(prefill)])
        y = _clamp(float(seconds), MIN_STEP_S, MAX_STEP_S, MAX_STEP_S)
        if not self._scaled:
            scale = y / float(np.dot(x, self._anchor.as_vector()))
            self._anchor = StepCosts.clamped(self._anchor.as_vector() * scale)
            self._scaled = True
            self._refit()
        predicted = float(np.dot(x, self.costs.as_vector()))
        # Relative errors: a step's noise grows with its time, and a long prefill step must not outweigh
        # a hundred decodes. The fit weighs each step by 1 / predicted**2.
        error = y / predicted - 1
        deviation = max(self._deviation if self._deviation is not None else 0.25, MIN_DEVIATION)
        # The deviation sees each error up to MAX_ERROR: lone outliers widen it a little, a lasting
        # change (errors on every step of some kind) a lot, so that the fit follows it.
        self._deviation = DEVIATION_DECAY * deviation + (1 - DEVIATION_DECAY) * min(abs(error), MAX_ERROR)
        error = min(max(error, -HUBER * deviation), HUBER * deviation)
        x /= predicted
        self._gram = DECAY * self._gram + np.outer(x, x)
        self._moment = DECAY * self._moment + x * (1 + error)
        self.steps += 1
        self._refit()

    def _refit(self) -> None:
        anchor = self._anchor.as_vector()
        # The anchor weighs as ANCHOR_STEPS steps of each kind's typical count, each weighted by its
        # time as every step is (the last fit's: 4 decodes, with 4 drafts for the draft cost, or 256
        # prefill tokens).
        now = self.costs
        decode_step = now.time(4, 0, 0)
        typical_time = np.array([decode_step, decode_step, now.time(4, 4, 0), now.time(0, 0, 256)])
        weights = ANCHOR_STEPS * (_TYPICAL / typical_time) ** 2
        # The draft figure's weight ties it to the decode figure (a penalty on their difference) rather
        # than to the anchor's draft figure.
        tie = weights[2] * np.outer(_DRAFT_LESS_DECODE, _DRAFT_LESS_DECODE)
        weights[2] = 0.0
        ridge = np.diag(weights)
        try:
            fit = np.linalg.solve(self._gram + ridge + tie, self._moment + ridge @ anchor)
        except np.linalg.LinAlgError:
            return  # keeps the last figures
        self.costs = StepCosts.clamped(fit)


class RowShares(Protocol):
    """What the drafter weighs a draft row by (StepCosts for one fit, LoadCosts for one per load)."""

    def row_share(self, load: int) -> float: ...


def load_bucket(load: int) -> int:
    """The index of the last of LOAD_BUCKETS at or below `load` (the first for any load below it)."""
    return max(bisect.bisect_right(LOAD_BUCKETS, load) - 1, 0)


@dataclass(frozen=True)
class LoadCosts:
    """The fit over every step, and each load bucket's own (None until it has seen MIN_BUCKET_STEPS)."""

    overall: StepCosts
    by_load: tuple[StepCosts | None, ...]

    def at(self, load: int) -> StepCosts:
        own = self.by_load[load_bucket(load)]
        return self.overall if own is None else own

    def row_share(self, load: int) -> float:
        return self.at(load).row_share(load)


class LoadCostEstimator:
    """A StepCostEstimator over every step, and one per load bucket over the steps of its loads, all
    anchored alike. A step's time is not linear in its rows on a CPU (weights read once serve every row,
    and the products change tiles with the row count), so one line through steps of eight sequences and
    steps of one sequence with drafts misjudges both: after a burst of eight streams, one line fitted a
    lone stream's draft row at three times its decode row, and the drafter stopped drafting."""

    def __init__(self, row_cost: float) -> None:
        self.overall = StepCostEstimator(row_cost)
        self._by_load = [StepCostEstimator(row_cost) for _ in LOAD_BUCKETS]

    @property
    def steps(self) -> int:
        return self.overall.steps

    @property
    def costs(self) -> LoadCosts:
        return LoadCosts(
            self.overall.costs,
            tuple(e.costs if e.steps >= MIN_BUCKET_STEPS else None for e in self._by_load),
        )

    def anchor(self, costs: StepCosts) -> None:
        """Pull every fit toward `costs` from now on (the probe's figures)."""
        self.overall.anchor(costs)
        for estimator in self._by_load:
            estimator.anchor(costs)

    def observe(self, decodes: int, drafts: int, prefill: int, seconds: float) -> None:
        """As StepCostEstimator.observe, into the overall fit and, where it decodes, its load's bucket (a
        step of prompt chunks alone says nothing of what a decoding step's rows cost)."""
        self.overall.observe(decodes, drafts, prefill, seconds)
        load = min(max(int(decodes), 0), MAX_ROWS)
        if load:
            self._by_load[load_bucket(load)].observe(decodes, drafts, prefill, seconds)
