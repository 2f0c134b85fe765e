"""Drives a workload against several targets, interleaved, so that their ratios survive a noisy machine.

The run advances in steps. A step sends the next turn of every conversation in flight to one target, all
at once, and waits for the replies; then the same step runs on the next target. Only one target works at
a time, so servers sharing the machine do not slow each other down, and a slow minute of the machine
hits every target alike. The order of targets alternates from step to step so that none always goes
first. Each target keeps its own history per conversation: the assistant turns it resends are its own
replies.
"""

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from kvserve_bench.client import RequestResult, Target, retryable, stream_chat
from kvserve_bench.errors import BenchError
from kvserve_bench.metrics_scrape import (
    PrefixCacheDelta,
    SpeculationDelta,
    prefix_cache_delta,
    scrape,
    speculation_delta,
)
from kvserve_bench.workloads import Conversation, Message, Workload

# Text of the warm-up request, which no workload text starts with (those are lowercase words).
_WARMUP_TEXT = "Say hello."


@dataclass
class TargetRun:
    """One target's part of a run: its requests, the time it spent serving them, its own counters."""

    target: Target
    results: list[RequestResult] = field(default_factory=list)
    busy_s: float = 0.0
    prefix_cache: PrefixCacheDelta | None = None
    speculation: SpeculationDelta | None = None


@dataclass
class _History:
    messages: list[Message]
    failed: bool = False


async def run_workload(
    workload: Workload,
    targets: Sequence[Target],
    seed: int,
    request_timeout_s: float,
    on_requests_done: Callable[[int], None] = lambda n: None,
    retries: int = 0,
) -> list[TargetRun]:
    """Runs `workload` on every target; `on_requests_done(n)` reports progress in requests. A request
    that fails for a reason another attempt may not meet is sent again, up to `retries` times."""
    limits = httpx.Limits(max_connections=max(100, 2 * workload.max_in_flight))
    timeout = httpx.Timeout(request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        runs = [TargetRun(target) for target in targets]
        for run in runs:
            await _warm_up(client, run.target, seed)
        before = [await scrape(client, run.target.url) for run in runs]
        await _Driver(client, workload, runs, seed, on_requests_done, retries).run_steps()
        for run, scraped in zip(runs, before, strict=True):
            after = await scrape(client, run.target.url)
            run.prefix_cache = prefix_cache_delta(scraped, after)
            run.speculation = speculation_delta(scraped, after)
    return runs


async def _warm_up(client: httpx.AsyncClient, target: Target, seed: int) -> None:
    """One short request, so that no target's first measured request pays for lazy start-up work."""
    result = RequestResult(target.name, "warm-up", -1, 0, 0.0)
    await stream_chat(client, target, [{"role": "user", "content": _WARMUP_TEXT}], 2, seed, result)
    if result.error is not None:
        raise BenchError(f"target {target.name} ({target.url}) failed a warm-up request: {result.error}")


class _Driver:
    """The state of one run: the client, the histories of every (target, conversation), the clock."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        workload: Workload,
        runs: list[TargetRun],
        seed: int,
        on_requests_done: Callable[[int], None],
        retries: int = 0,
    ) -> None:
        self.retries = retries
        self.client = client
        self.workload = workload
        self.runs = runs
        self.seed = seed
        self.on_requests_done = on_requests_done
        self.histories = {
            (run.target.name, c.id): _History(_opening(c)) for run in runs for c in workload.conversations
        }
        self.start = time.perf_counter()

    async def run_steps(self) -> None:
        pending = list(reversed(self.workload.conversations))
        active: list[Conversation] = []
        next_turn: dict[str, int] = {}
        step = 0
        while pending or active:
            while pending and len(active) < self.workload.max_in_flight:
                conversation = pending.pop()
                active.append(conversation)
                next_turn[conversation.id] = 0
            for run in self.runs if step % 2 == 0 else self.runs[::-1]:
                step_start = time.perf_counter()
                await asyncio.gather(
                    *(
                        self.send_turn(run, c, next_turn[c.id], step_start)
                        for c in active
                        if not self.histories[run.target.name, c.id].failed
                    )
                )
                run.busy_s += time.perf_counter() - step_start
            for conversation in active:
                next_turn[conversation.id] += 1
            active = [c for c in active if next_turn[c.id] < len(c.user_turns) and not self.all_failed(c)]
            step += 1

    def all_failed(self, conversation: Conversation) -> bool:
        return all(self.histories[run.target.name, conversation.id].failed for run in self.runs)

    async def send_turn(
        self, run: TargetRun, conversation: Conversation, turn: int, step_start: float
    ) -> None:
        if turn == 0 and conversation.arrival_s > 0:
            await asyncio.sleep(max(0.0, step_start + conversation.arrival_s - time.perf_counter()))
        history = self.histories[run.target.name, conversation.id]
        history.messages.append({"role": "user", "content": conversation.user_turns[turn]})
        attempt = 0
        while True:
            result = RequestResult(
                run.target.name,
                conversation.id,
                conversation.group,
                turn + 1,
                time.perf_counter() - self.start,
                retries=attempt,
            )
            reply = await stream_chat(
                self.client,
                run.target,
                history.messages,
                self.workload.max_tokens,
                self.seed,
                result,
                ignore_eos=self.workload.ignore_eos,
            )
            if result.error is None or attempt >= self.retries or not retryable(result.error):
                break
            attempt += 1
        run.results.append(result)
        history.messages.append({"role": "assistant", "content": reply})
        if result.error is None:
            self.on_requests_done(1)
        else:
            # The conversation cannot go on without this reply; its remaining turns count as done.
            history.failed = True
            self.on_requests_done(len(conversation.user_turns) - turn)


def _opening(conversation: Conversation) -> list[Message]:
    system = [] if conversation.system is None else [{"role": "system", "content": conversation.system}]
    return [*system, *conversation.opening]
