"""Two replicas sharing a real Redis, behind a real SMG router (`cache_aware`), on loopback: the tenant
(the default one: no keys) has one namespace on both (one secret file), so a replica finds a
conversation that another computed; when the replica serving a stream is killed, the stream fails
cleanly, and its retry goes to the other replica, which finds the conversation's prefix in Redis."""

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvserve.cluster.launch import Cluster, ClusterConfig
from kvserve.cluster.redis_process import free_port
from kvserve_bench.client import RequestResult, Target, stream_chat
from tests.cluster.cluster_harness import MODEL, system_prompt


def chat(url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + "{") and 'tier="redis"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the metrics")


def wait_for_stores(url: str, blocks: int) -> None:
    """Stores are written behind the step: wait until the replica has written `blocks` of them."""
    deadline = time.monotonic() + 60
    while metric(url, "kvserve_kv_tier_stores_total") < blocks:
        assert time.monotonic() < deadline, "the replica never wrote its blocks to Redis"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    run_dir = tmp_path_factory.mktemp("cluster")
    c = Cluster(
        ClusterConfig(
            replicas=2,
            threads=2,
            port=free_port(),
            redis_maxmemory="256mb",
            serve_args=["--kv-cache-memory", "128MiB"],
            run_dir=str(run_dir),
        )
    )
    c.start()
    yield c
    c.stop()


def test_two_replicas_behind_smg_share_prefixes_through_redis(cluster: Cluster) -> None:
    a, b = (r.url for r in cluster.replicas)
    messages = [{"role": "system", "content": system_prompt("apples")}, {"role": "user", "content": "Sum?"}]
    first = chat(a, messages)
    prompt_tokens = first["usage"]["prompt_tokens"]
    full_blocks = (prompt_tokens - 1) // 16
    wait_for_stores(a, full_blocks)
    # The other replica has never seen this prompt: its blocks come from Redis, under the same
    # namespace (one secret file), with the same greedy answer.
    second = chat(b, messages)
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= full_blocks * 16 - 16
    assert metric(b, "kvserve_kv_tier_loads_total") >= full_blocks - 1
    routed = chat(cluster.url, messages)
    assert routed["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def running(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("vllm:num_requests_running{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no running-requests gauge")


def test_a_killed_replicas_stream_fails_cleanly_and_its_retry_continues_from_redis(cluster: Cluster) -> None:
    messages = [{"role": "system", "content": system_prompt("pears")}, {"role": "user", "content": "Total?"}]
    turn = chat(cluster.url, messages)
    prompt_tokens = turn["usage"]["prompt_tokens"]
    deadline = time.monotonic() + 60
    while sum(metric(r.url, "kvserve_kv_tier_stores_total") for r in cluster.replicas) < 2 * (
        (prompt_tokens - 1) // 16
    ):
        assert time.monotonic() < deadline, "the blocks never reached Redis"
        time.sleep(0.2)
    messages += [turn["choices"][0]["message"], {"role": "user", "content": "And the heaviest?"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    # A long stream of the next turn; once it is streaming, the replica serving it is killed.
    result = RequestResult("smg", "c", 0, 2, 0.0)

    async def stream_and_kill() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            task = asyncio.create_task(
                stream_chat(client, Target("smg", cluster.url, MODEL), messages, 400, 0, result)
            )
            serving = None
            while serving is None:
                await asyncio.sleep(0.2)
                assert not task.done(), result.error
                busy = [i for i, r in enumerate(cluster.replicas) if running(r.url) > 0]
                serving = busy[0] if busy else None
            await asyncio.sleep(0.5)
            cluster.kill_replica(serving)
            await task

    asyncio.run(stream_and_kill())
    # The client learns that the reply is incomplete (SMG ends the stream with an error event), never
    # a silently short answer.
    assert result.error is not None
    # Its retry goes to the live replica (until SMG's health check drops the dead one, a request routed
    # there fails with a 5xx that a client retries) and finds the conversation's prefix in Redis.
    deadline = time.monotonic() + 60
    body["max_tokens"] = 6
    while True:
        r = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=300)
        if r.status_code == 200:
            break
        assert r.status_code >= 500, r.text
        assert time.monotonic() < deadline, "the router kept sending requests to the dead replica"
        time.sleep(0.5)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens - 32
