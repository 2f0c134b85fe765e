"""Replicas behind SMG, with and without the shared Redis tier, against one node with the same threads.

Setups: one replica (all threads) and two replicas (threads split) behind SMG with `cache_aware` and
with `round_robin`, each with and without Redis. Workloads (small, for a shared 2-core machine):
shared-prefix and multi-turn, through the router. Reported per setup: prefill tokens computed across the
cluster (the sum of every replica's `kvserve_prefill_tokens_computed`), cached fraction, TTFT and output
throughput. Then a replica is killed and restarted: the first turn of a conversation it had served,
sent to it again, with and without Redis (TTFT); and a multi-turn run through the router with one
replica killed mid-run, counting failed, retried and recovered requests (`--retries 1`).

Run: `make bench-cluster` (writes benchmarks/results/cluster.{json,md} and cluster-*.png).
"""

import asyncio
import dataclasses
import threading
import time
from typing import Any

import httpx
from matplotlib.figure import Figure

from benchmarks.common import RESULTS, write_results
from kvserve.cluster.launch import Cluster, ClusterConfig
from kvserve.cluster.redis_process import free_port
from kvserve_bench.client import RequestResult, Target, stream_chat
from kvserve_bench.metrics_scrape import parse_samples
from kvserve_bench.report import summarize
from kvserve_bench.runner import run_workload
from kvserve_bench.tokens import local_counter, text_of_tokens, text_only
from kvserve_bench.workloads import MultiturnSpec, SharedPrefixSpec, Workload, multiturn, shared_prefix

THREADS = 2
SERVE_ARGS = ["--kv-cache-memory", "256MiB"]
# Poisson arrivals (0.5/s): a group's later prompts arrive after its first one's prefill, as in a real
# service; sent all at once, every replica would compute the prefix before any had stored it.
SHARED_PREFIX = SharedPrefixSpec(
    groups=2, prompts_per_group=4, system_tokens=600, question_tokens=20, output_tokens=8, request_rate=0.5
)
MULTITURN = MultiturnSpec(conversations=4, turns=3, system_tokens=400, user_tokens=30, reply_tokens=8)
SETUPS: list[tuple[str, int, str, bool]] = [
    ("1 node", 1, "cache_aware", False),
    ("2x cache_aware", 2, "cache_aware", False),
    ("2x cache_aware + redis", 2, "cache_aware", True),
    ("2x round_robin", 2, "round_robin", False),
    ("2x round_robin + redis", 2, "round_robin", True),
]
RESTART_SYSTEM_TOKENS = 1500


def cluster(replicas: int, policy: str, redis: bool) -> Cluster:
    return Cluster(
        ClusterConfig(
            replicas=replicas,
            threads=THREADS,
            port=free_port(),
            policy=policy,
            redis=redis,
            redis_maxmemory="512mb",
            serve_args=SERVE_ARGS,
        )
    )


def computed(c: Cluster) -> float:
    """Prefill tokens computed so far, summed over the live replicas."""
    total = 0.0
    for r in c.replicas:
        if r.process is not None and r.process.poll() is None:
            total += parse_samples(httpx.get(f"{r.url}/metrics", timeout=30).text)[
                "kvserve_prefill_tokens_computed"
            ]
    return total


def run(c: Cluster, workload: Workload, retries: int = 0) -> dict[str, Any]:
    target = Target("smg", c.url, "SmolLM2-135M-Instruct")
    before = computed(c)
    [target_run] = asyncio.run(run_workload(workload, [target], 0, 600, retries=retries))
    s = summarize(target_run)
    return {
        "prefill_tokens_computed": computed(c) - before,
        "cached_fraction": s.cached_fraction,
        "ttft_p50_s": s.ttft_s.p50,
        "output_tokens_per_s": s.output_tokens_per_s,
        "requests": s.requests,
        "errors": s.errors,
        "retried": s.retried,
        "recovered": s.recovered,
    }


def first_turn_after_restart(redis: bool) -> float:
    """TTFT of a known conversation's next turn on a replica killed and restarted since its first turn."""
    c = cluster(2, "cache_aware", redis)
    c.start()
    try:
        replica = c.replicas[0]
        system = text_of_tokens(RESTART_SYSTEM_TOKENS, "restart", text_only(local_counter()))
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Summarize."}]
        target = Target("replica", replica.url, "SmolLM2-135M-Instruct")

        async def turn() -> RequestResult:
            result = RequestResult("replica", "c", 0, 1, 0.0)
            async with httpx.AsyncClient(timeout=600) as client:
                reply = await stream_chat(client, target, messages, 8, 0, result)
            messages.append({"role": "assistant", "content": reply})
            return result

        asyncio.run(turn())
        time.sleep(3)  # the writer sends the blocks behind the step
        c.kill_replica(0)
        c.start_replica(0)
        messages.append({"role": "user", "content": "And in one word?"})
        result = asyncio.run(turn())
        assert result.error is None and result.ttft_s is not None, result.error
        return result.ttft_s
    finally:
        c.stop()


def killed_mid_run(redis: bool) -> dict[str, Any]:
    c = cluster(2, "cache_aware", redis)
    c.start()
    try:
        spec = dataclasses.replace(MULTITURN, conversations=6, turns=4, seed=7)
        workload = multiturn(spec, text_only(local_counter()))
        killer = threading.Timer(8.0, c.kill_replica, args=(1,))
        killer.start()
        out = run(c, workload, retries=1)
        killer.cancel()
        return out
    finally:
        c.stop()


def plot(results: dict[str, Any]) -> list[str]:
    names = []
    for workload in ("shared-prefix", "multiturn"):
        fig = Figure(figsize=(7, 3.5))
        ax = fig.add_subplot()
        setups = list(results["setups"])
        ax.bar(setups, [results["setups"][s][workload]["prefill_tokens_computed"] for s in setups])
        ax.set_ylabel("prefill tokens computed (cluster)")
        ax.set_title(f"{workload}: prefill computed across the cluster")
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
        fig.tight_layout()
        name = f"cluster-{workload}.png"
        fig.savefig(f"{RESULTS}/{name}", dpi=100)
        names.append(name)
    return names


def main() -> None:
    count = text_only(local_counter())
    results: dict[str, Any] = {"threads": THREADS, "setups": {}}
    for name, replicas, policy, redis in SETUPS:
        c = cluster(replicas, policy, redis)
        c.start()
        try:
            results["setups"][name] = {
                "shared-prefix": run(c, shared_prefix(SHARED_PREFIX, count)),
                "multiturn": run(c, multiturn(MULTITURN, count)),
            }
        finally:
            c.stop()
        print(name, results["setups"][name], flush=True)
    results["restart_ttft_s"] = {
        "redis": first_turn_after_restart(True),
        "no redis": first_turn_after_restart(False),
    }
    print("restart", results["restart_ttft_s"], flush=True)
    results["killed_mid_run"] = {"redis": killed_mid_run(True)}
    print("killed", results["killed_mid_run"], flush=True)
    images = plot(results)
    lines = [
        f"Setups behind SMG on one 2-core machine ({THREADS} threads in all), small workloads.",
        "",
        "| setup | workload | prefill computed | cached fraction | TTFT p50 (ms) | output tok/s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, workloads in results["setups"].items():
        for workload, r in workloads.items():
            ttft = r["ttft_p50_s"]
            cached = f"{100 * (r['cached_fraction'] or 0):.1f}%"
            numbers = "- | -" if ttft is None else f"{1000 * ttft:.0f} | {r['output_tokens_per_s'] or 0:.1f}"
            lines.append(
                f"| {name} | {workload} | {r['prefill_tokens_computed']:.0f} | {cached} | {numbers} |"
            )
    restart = results["restart_ttft_s"]
    killed = results["killed_mid_run"]["redis"]
    lines += [
        "",
        f"A replica killed and restarted, then the next turn of a {RESTART_SYSTEM_TOKENS}-token "
        f"conversation it had served: TTFT {1000 * restart['redis']:.0f} ms with Redis, "
        f"{1000 * restart['no redis']:.0f} ms without ({restart['no redis'] / restart['redis']:.1f}x).",
        "",
        f"A replica killed 8 s into a multi-turn run through the router (Redis on, client retries once): "
        f"{killed['requests']} requests, {killed['errors']} failed, {killed['retried']} retried, "
        f"{killed['recovered']} of those recovered.",
        "",
        *(f"![{name}]({name})" for name in images),
    ]
    table = "\n".join(lines) + "\n"
    print(table)
    write_results("cluster", results, table)


if __name__ == "__main__":
    main()
