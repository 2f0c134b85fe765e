"""`kvserve bench --retries`: a request that fails on the connection is sent again, once per retry, and
the report counts the retried requests and those that then succeeded; a 4xx is never retried."""

import asyncio

import httpx

from kvserve_bench.client import Target, retryable
from kvserve_bench.report import summarize
from kvserve_bench.runner import TargetRun, _Driver
from kvserve_bench.workloads import Conversation, Workload
from tests.helpers import free_port


def test_a_refused_request_is_retried_and_counted() -> None:
    # A real refused connection: nothing listens on the port (a replica that just died).
    target = Target("dead", f"http://127.0.0.1:{free_port()}", "m")
    conversation = Conversation("c0", 0, None, ("hello", "again"))
    workload = Workload("w", "one conversation", (conversation,), 4, 1, {})
    run = TargetRun(target)

    async def drive() -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            await _Driver(client, workload, [run], 0, lambda n: None, retries=1).run_steps()

    asyncio.run(drive())
    # The first turn failed twice (the second attempt was its retry); the conversation stopped there.
    [result] = run.results
    assert result.retries == 1 and result.error is not None
    summary = summarize(run)
    assert (summary.requests, summary.errors, summary.retried, summary.recovered) == (1, 1, 1, 0)


def test_only_failures_another_attempt_may_not_meet_are_retried() -> None:
    assert retryable("ConnectError: [Errno 111] Connection refused")
    assert retryable("HTTP 503: no worker available")
    assert retryable("error in stream: the engine stopped")
    assert not retryable("HTTP 400: max_tokens must be positive")
    assert not retryable("HTTP 429: too many requests in flight")
