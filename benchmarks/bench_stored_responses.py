"""What stored responses cost a real server (`kvserve serve` on loopback, the default model): its RSS
before and after storing 4 responses whose ~7 MiB bodies carry a hosted tool full of junk (`{}` a few
million times, the review's probe), beside the same 4 with `store: false`; then the wall time of a GET
of one of them and of a GET of a response as large that is all the request's own (a 6 MiB `user`),
and `/health`'s latency while such GETs run back to back.

Run: `python -m benchmarks.bench_stored_responses`; with another checkout's sources first on
PYTHONPATH to compare. `KVSERVE_BENCH_PORT` picks the port (8931).
"""

import json
import os
import statistics
import threading
import time
from typing import Any

import httpx

from benchmarks.common import start_server, status_bytes

PORT = int(os.environ.get("KVSERVE_BENCH_PORT", "8931"))
URL = f"http://127.0.0.1:{PORT}"
RESPONSES = 4
# 120,000 dicts once parsed, within the server's bound on one body (2**17 arrays and objects); before
# that bound, the probe was 1.8 million (7 MiB of JSON).
JUNK = "[" + ", ".join(["{}"] * 120_000) + "]"


def _junk_body(store: bool) -> bytes:
    head = json.dumps({"input": "Hi.", "max_output_tokens": 4, "temperature": 0, "store": store})
    return (head[:-1] + ', "tools": [{"type": "web_search", "junk": ' + JUNK + "}]}").encode()


def _post(body: bytes) -> dict[str, Any]:
    reply = httpx.post(
        f"{URL}/v1/responses", content=body, headers={"Content-Type": "application/json"}, timeout=600
    )
    reply.raise_for_status()
    result: dict[str, Any] = reply.json()
    return result


def _get_and_health(response_id: str) -> tuple[float, float, float]:
    """The median GET's wall time, and /health's median and worst latency while GETs run."""
    gets = []
    for _ in range(5):
        start = time.perf_counter()
        httpx.get(f"{URL}/v1/responses/{response_id}", timeout=60).raise_for_status()
        gets.append(time.perf_counter() - start)
    done = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=60) as client:
            while not done.is_set():
                client.get(f"{URL}/v1/responses/{response_id}")

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    health = []
    with httpx.Client(timeout=60) as client:
        for _ in range(20):
            start = time.perf_counter()
            client.get(f"{URL}/health").raise_for_status()
            health.append(time.perf_counter() - start)
            time.sleep(0.05)
    done.set()
    for t in threads:
        t.join()
    return statistics.median(gets), statistics.median(health), max(health)


def run(store: bool) -> dict[str, Any]:
    process = start_server(["--port", str(PORT), "--max-model-len", "1024", "--kv-cache-memory", "64MiB"])
    try:
        _post(json.dumps({"input": "Hi.", "max_output_tokens": 4}).encode())
        time.sleep(1)
        before = status_bytes(process.pid, "VmRSS") / 2**20
        made = [_post(_junk_body(store)) for _ in range(RESPONSES)]
        time.sleep(1)
        result: dict[str, Any] = {
            "store": store,
            "rss_before_mib": before,
            "rss_after_mib": status_bytes(process.pid, "VmRSS") / 2**20,
        }
        if store:
            result["junk_get_s"], result["junk_health_median_s"], result["junk_health_max_s"] = (
                _get_and_health(made[-1]["id"])
            )
            own = _post(
                json.dumps({"input": "Hi.", "max_output_tokens": 4, "user": "u" * (6 * 2**20)}).encode()
            )
            result["own_get_s"], result["own_health_median_s"], result["own_health_max_s"] = _get_and_health(
                own["id"]
            )
            result["own_bytes"] = len(json.dumps(own))
        return result
    finally:
        process.terminate()
        process.wait(timeout=60)


def main() -> None:
    for store in (False, True):
        print(json.dumps(run(store)), flush=True)


if __name__ == "__main__":
    main()
