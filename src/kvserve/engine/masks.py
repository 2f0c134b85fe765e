"""Token masks of a step's constrained rows, computed off the engine thread's critical path.

The mask of a row that will sample depends only on the tokens its request has taken, not on this step's
logits. So `Engine.step` starts the masks (`MaskWorker.start`) before the forward pass, a thread of their
own computes them while the engine thread runs it, and the sampler joins them (`StepMasks.allowed`). The
library fills the rows in parallel (`fill_next_token_bitmask_par` on an `LLExecutor`: its own threads,
with the GIL released). Each row's work is bounded by the grammar limits' step fuel; a matcher that
reaches a limit leaves its row nothing but the end of sequence, and its state a `failure`, which ends that
request alone ("grammar_limit", see Request.append).
"""

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from kvserve.engine.bitmask import fill_rows, new_bitmask
from kvserve.engine.grammar import GrammarState
from kvserve.engine.request import Request

# A job: a state and, when the state has not seen exactly its request's output, that output to replay.
_Job = tuple[GrammarState, list[int] | None]


def _jobs(requests: Sequence[Request]) -> list[_Job]:
    jobs: list[_Job] = []
    for r in requests:
        if r.grammar is not None:
            behind = r.grammar.num_tokens != r.num_output_tokens
            jobs.append((r.grammar, r.output_token_ids if behind else None))
    return jobs


def _bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    # On the engine thread: a torch fill may open a parallel region, and the mask thread opens none.
    return new_bitmask(num_rows, vocab_size)


def _sync(jobs: Sequence[_Job]) -> None:
    for state, output in jobs:
        if output is not None:
            state.sync(output)


class StepMasks:
    """The masks of one step's constrained rows, in the order of their requests: being computed
    (`future`), or computed."""

    def __init__(
        self, states: list[GrammarState], bitmask: torch.Tensor, future: "Future[None] | None" = None
    ) -> None:
        self.states = states
        self._bitmask = bitmask
        self._future = future

    def covers(self, states: Sequence[GrammarState]) -> bool:
        """Whether these masks are for exactly these states, in this order."""
        return len(states) == len(self.states) and all(
            a is b for a, b in zip(states, self.states, strict=True)
        )

    def allowed(self, width: int) -> torch.Tensor:
        """[rows, width] bool: the tokens each state allows next, once they are computed. Tokens past the
        tokenizer's vocabulary (a padded output layer) are never allowed; a tokenizer larger than the
        layer is cut. A state whose matcher failed gets its `failure` recorded."""
        if self._future is not None:
            self._future.result()
            self._future = None
        for state in self.states:
            state.check_failure()
        vocab_size = self.states[0].vocab_size
        bits = torch.arange(32, dtype=torch.int32)
        allowed = ((self._bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab_size]
        if width <= vocab_size:
            return allowed[:, :width]
        extra = torch.zeros(len(self.states), width - vocab_size, dtype=torch.bool)
        return torch.cat([allowed, extra], dim=1)


def compute_masks(requests: Sequence[Request]) -> StepMasks | None:
    """The masks of the constrained requests among `requests`, computed now on this thread, one row
    after another (for callers without a MaskWorker: tests, benchmarks)."""
    jobs = _jobs(requests)
    if not jobs:
        return None
    _sync(jobs)
    bitmask = _bitmask(len(jobs), jobs[0][0].vocab_size)
    for row, (state, _) in enumerate(jobs):
        state.fill_bitmask(bitmask, row)
    return StepMasks([state for state, _ in jobs], bitmask)


class MaskWorker:
    """Starts each step's masks on a thread of its own; the thread and the library's executor are made
    on the first constrained step, so an engine that never sees a constraint starts neither."""

    def __init__(self) -> None:
        self._thread: ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None

    def start(self, requests: Sequence[Request]) -> StepMasks | None:
        """Begin the masks of the constrained requests among `requests` (the step's sampling rows);
        None when none is constrained. Until `allowed` returns, their states belong to the mask thread."""
        jobs = _jobs(requests)
        if not jobs:
            return None
        if self._thread is None or self._executor is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvserve-masks")
            self._executor = llguidance.LLExecutor()
        bitmask = _bitmask(len(jobs), jobs[0][0].vocab_size)
        future = self._thread.submit(_fill, self._executor, jobs, bitmask)
        return StepMasks([state for state, _ in jobs], bitmask, future)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None


def _fill(executor: llguidance.LLExecutor, jobs: Sequence[_Job], bitmask: torch.Tensor) -> None:
    _sync(jobs)
    matchers = [(state.matcher, row) for row, (state, _) in enumerate(jobs)]
    fill_rows(executor, matchers, bitmask)
