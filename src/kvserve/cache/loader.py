"""BlockLoader: reads an admission's blocks from the lower tiers off the engine thread.

A disk read, a Redis round trip and a MAC check all take time that the engine thread must not spend:
a step that admits many requests would wait for every one of them, and every stream running waits with
it. So the engine thread only asks the loader for the run of blocks that would continue a prompt's memory
match (`submit`), and the request waits while the steps go on. The loader's threads read and verify the
blocks into host tensors (`LowerTiers.read_run`); a later admission takes what has arrived (`take`) and
copies it into pool blocks on the engine thread. A hybrid model's job then looks for the newest state
checkpoint within the KV it reaches (tier_states.py), in the same budget, held like the blocks.

Invariants:
- The loader never touches the KV pool or the prefix tree: it holds host tensors only, and the
  KVCacheManager alone decides which pool block receives them.
- A job reads for at most its budget (`budget_s`, from when a loader thread takes it up: a job queued
  behind others waits its turn rather than expire unread, since reading even a slow tier's blocks costs
  far less than computing them): it is `ready` once its run has been read or its budget is over,
  whichever comes first, and a reader stops at its next block once the job is over (taken, cancelled or
  out of time). A read already sent finishes on the loader's thread, and its result is dropped.
- The tensors arrived and not taken never exceed `max_bytes` (but one block always fits): a reader waits
  for room, within its job's budget, then stops.
- A job taken or cancelled gives back its bytes at once; nothing it read afterwards is kept.
"""

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from kvserve.cache.lower_tiers import LowerTiers
from kvserve.cache.tier_states import FoundState, TierStates, WantedState
from kvserve.cache.tiers import Arrived

log = logging.getLogger("kvserve.cache")

# Seconds of reading a request's blocks get, then it is admitted with what has arrived. Above the Redis
# tier's own budget for a run (1 s of reads, and the read under way: at most one 0.5 s timeout more), so
# that a run Redis is still answering is never cut short; what bounds a disk read.
LOAD_BUDGET_S = 2.0
# Blocks read and not yet copied into the pool, all jobs together.
LOAD_BYTES = 256 * 2**20
# Two reads at a time: more in parallel against a slow Redis only made its replies miss the socket
# timeout together (measured with benchmarks/bench_paused_redis.py).
LOADER_THREADS = 2


def _nbytes(kv: torch.Tensor) -> int:
    return kv.numel() * kv.element_size()


@dataclass(eq=False)
class LoadJob:
    """The blocks `start..` of `tokens` (whole blocks of a prompt's cacheable prefix) in `namespace`, as
    the loader reads them: `arrived[i]` is (tier name, verified KV) of block `start + i`."""

    namespace: str
    tokens: tuple[int, ...]
    start: int
    # When its budget ends: set as a loader thread takes it up (or given, for a job read again).
    deadline: float | None = None
    arrived: list[Arrived] = field(default_factory=list)
    nbytes: int = 0
    done: bool = False
    over: bool = False
    # When its reader finished (None: still reading): past the deadline, its budget ran out first.
    done_at: float | None = None
    # A hybrid model's admission: the state checkpoint it looks for once its blocks are read, and the
    # one found (tier_states.py).
    wanted: WantedState | None = None
    state: FoundState | None = None

    @property
    def timed_out(self) -> bool:
        """Whether its budget ran out before its run was read (checked once it is ready)."""
        if self.deadline is None:
            return False
        return self.done_at is None or self.done_at >= self.deadline


class BlockLoader:
    def __init__(
        self,
        lower: LowerTiers,
        *,
        states: TierStates | None = None,
        budget_s: float = LOAD_BUDGET_S,
        max_bytes: int = LOAD_BYTES,
        threads: int = LOADER_THREADS,
    ) -> None:
        self.lower = lower
        self.states = states
        self.budget_s = budget_s
        self.max_bytes = max_bytes
        self._cond = threading.Condition()
        self._queue: deque[LoadJob] = deque()
        # Jobs submitted and neither taken nor cancelled.
        self._jobs: set[LoadJob] = set()
        self._bytes = 0
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"kvserve-loader-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    # The engine thread's side.

    def submit(
        self,
        namespace: str,
        tokens: tuple[int, ...],
        start: int,
        deadline: float | None = None,
        wanted: WantedState | None = None,
    ) -> LoadJob:
        """Read blocks `start..` of `tokens` (then the state checkpoint `wanted`) until `deadline` (by
        default, the budget from when a loader thread takes the job up)."""
        job = LoadJob(namespace, tokens, start, deadline, wanted=wanted)
        with self._cond:
            self._jobs.add(job)
            self._queue.append(job)
            self._cond.notify_all()
        return job

    @staticmethod
    def ready(job: LoadJob) -> bool:
        """Whether the job's run has been read, or its budget is over: its request may be admitted."""
        return job.done or (job.deadline is not None and time.monotonic() >= job.deadline)

    def take(self, job: LoadJob) -> list[Arrived]:
        """The blocks arrived so far, in order; the job is over (nothing more is read for it)."""
        with self._cond:
            arrived = job.arrived
            self._end(job)
        return arrived

    def take_state(self, job: LoadJob) -> FoundState | None:
        """The state checkpoint found for the job (before `take`, which ends it)."""
        with self._cond:
            return job.state

    def cancel(self, job: LoadJob) -> None:
        """The request left (aborted, finished): drop the job and what it read."""
        with self._cond:
            self._end(job)

    def _end(self, job: LoadJob) -> None:
        """Caller holds the lock."""
        job.over = True
        job.arrived = []
        job.state = None
        self._bytes -= job.nbytes
        job.nbytes = 0
        self._jobs.discard(job)
        if job in self._queue:
            self._queue.remove(job)
        self._cond.notify_all()

    @property
    def pending(self) -> int:
        """Jobs submitted and neither taken nor cancelled (ready or not)."""
        with self._cond:
            return len(self._jobs)

    def wait(self, timeout_s: float) -> None:
        """Return once a job becomes ready, or after `timeout_s` (a step with nothing else to do)."""
        with self._cond:
            until = time.monotonic() + timeout_s
            while self._jobs and not any(self.ready(job) for job in self._jobs):
                # No job is ready: each deadline set is still ahead.
                left = min([until, *self._deadlines(self._jobs)]) - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def settle(self) -> None:
        """Wait until every job submitted is ready (tests: which blocks an admission finds is then a
        function of the workload, not of the loader's timing)."""
        with self._cond:
            while reading := [job for job in self._jobs if not self.ready(job)]:
                until = min(self._deadlines(reading), default=time.monotonic() + 0.05)
                self._cond.wait(max(until - time.monotonic(), 0.001))

    @staticmethod
    def _deadlines(jobs: Iterable[LoadJob]) -> list[float]:
        return [job.deadline for job in jobs if job.deadline is not None]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for job in list(self._jobs):
                self._end(job)
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()

    # The loader threads' side.

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                if job.deadline is None:
                    job.deadline = time.monotonic() + self.budget_s
            try:
                if not self._stopped(job):
                    self.lower.read_run(
                        job.namespace,
                        job.tokens,
                        job.start,
                        functools.partial(self._stopped, job),
                        functools.partial(self._arrive, job),
                    )
                if job.wanted is not None and self.states is not None and not self._stopped(job):
                    self._read_state(job, self.states, job.wanted)
            # The tiers turn their own errors into misses; anything else is the loader's bug, and must
            # not stop the thread that every later load needs.
            except Exception:
                log.warning("loading KV blocks failed; the rest of the prompt is computed", exc_info=True)
            finally:
                with self._cond:
                    job.done = True
                    job.done_at = time.monotonic()
                    self._cond.notify_all()

    def _read_state(self, job: LoadJob, states: TierStates, wanted: WantedState) -> None:
        """Look for the newest checkpoint the KV held for the job reaches (memory's, and the blocks
        read), past memory's last one."""
        end = max(wanted.end, (job.start + len(job.arrived)) * self.lower.block_size)
        found = states.read(
            job.namespace, wanted.tokens, wanted.after, end, functools.partial(self._stopped, job)
        )
        if found is None:
            return
        with self._cond:
            if not self._stopped(job):
                job.state = found
                job.nbytes += _nbytes(found.packed)
                self._bytes += _nbytes(found.packed)

    @classmethod
    def _stopped(cls, job: LoadJob) -> bool:
        return job.over or cls.ready(job)

    def _arrive(self, job: LoadJob, tier: str, kv: torch.Tensor) -> bool:
        """Keep a block read for `job`; False when the job is over and reading must stop."""
        size = _nbytes(kv)
        with self._cond:
            while not job.over and self._bytes and self._bytes + size > self.max_bytes:
                assert job.deadline is not None, "a job is read only once taken up"
                left = job.deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            if self._stopped(job):
                return False
            job.arrived.append((tier, kv))
            job.nbytes += size
            self._bytes += size
            return True
