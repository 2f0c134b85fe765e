"""What hostile bodies cost a real server: its resident memory under 8 MiB bodies of ignored `{}`, with a
key, and /health's latency and the server's CPU while keyless clients send such bodies without pause.

A real `kvserve serve` process (the default model, a small pool) behind a key file; memory is the
server's peak resident set (VmHWM, reset before each phase through /proc/PID/clear_refs); the keyless
flood runs in two processes of its own, and the server's CPU time over the flood is divided by the
keyless requests it answered. Run: `python -m benchmarks.bench_junk_flood` (prints one JSON object);
`--src DIR` serves another checkout's `src` (a version before a change) for the same measurement.
"""

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from benchmarks.common import start_server, status_bytes

KEY = "bench-junk-key-1"
JSON = {"content-type": "application/json"}
MiB = 2**20


def junk_body(size: int) -> bytes:
    """A chat request padded to `size` bytes with an ignored field of empty objects."""
    head = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "junk": ['
    count = (size - len(head) - 4) // 3
    return head + b"{}," * (count - 1) + b"{}]}"


def cpu_seconds(pid: int) -> float:
    """User and system CPU time the process has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def reset_hwm(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--src", help="serve this checkout's src folder instead of the installed kvserve")
    parser.add_argument("--port", type=int, default=18431)
    parser.add_argument("--in-flight", type=int, default=4, help="junk requests with a key at once")
    parser.add_argument("--health-probes", type=int, default=40)
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    body = junk_body(8 * MiB - 1024)
    headers = {"content-type": "application/json"}
    with tempfile.TemporaryDirectory() as folder:
        key_file = os.path.join(folder, "keys")
        with open(key_file, "w") as f:
            f.write(f"alice:{KEY}\n")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if args.src is not None:
            env["PYTHONPATH"] = os.path.abspath(args.src)
        flags = ["--port", str(args.port), "--kv-cache-memory", "32MiB", "--max-model-len", "512"]
        process = start_server([*flags, "--api-key-file", key_file], env)
        try:
            # Warm: the first request builds what later ones reuse.
            httpx.post(
                f"{url}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
                headers={"Authorization": f"Bearer {KEY}"},
                timeout=120,
            )
            idle_rss = status_bytes(process.pid, "VmRSS")
            reset_hwm(process.pid)
            keyed = {**headers, "Authorization": f"Bearer {KEY}"}
            with ThreadPoolExecutor(args.in_flight) as pool:
                statuses = list(
                    pool.map(
                        lambda _: (
                            httpx.post(
                                f"{url}/v1/chat/completions", content=body, headers=keyed, timeout=300
                            ).status_code
                        ),
                        range(args.in_flight),
                    )
                )
            junk_peak = status_bytes(process.pid, "VmHWM")

            # The flood runs in processes of its own, so that the probes' client never waits for it.
            context = multiprocessing.get_context("spawn")
            stop = context.Event()
            answered = context.Queue()
            flooders = [context.Process(target=flood, args=(url, stop, answered)) for _ in range(2)]
            alone = [probe(url) for _ in range(args.health_probes)]
            cpu_before = cpu_seconds(process.pid)
            for flooder in flooders:
                flooder.start()
            time.sleep(5)
            flooded = [probe(url) for _ in range(args.health_probes)]
            stop.set()
            keyless = [answered.get(timeout=300) for _ in flooders]
            for flooder in flooders:
                flooder.join()
            flood_cpu = cpu_seconds(process.pid) - cpu_before
        finally:
            process.terminate()
            process.wait(timeout=120)
    print(
        json.dumps(
            {
                "junk_requests": args.in_flight,
                "junk_statuses": sorted(set(statuses)),
                "idle_rss_mib": round(idle_rss / MiB),
                "peak_rss_under_junk_mib": round(junk_peak / MiB),
                "health_ms_alone_median": round(statistics.median(alone), 1),
                "health_ms_keyless_flood_median": round(statistics.median(flooded), 1),
                "health_ms_keyless_flood_max": round(max(flooded), 1),
                "keyless_requests_answered": sum(len(statuses) for statuses in keyless),
                # The server's CPU during the flood (the probes' included) over the keyless requests.
                "server_cpu_ms_per_keyless_request": round(
                    1000 * flood_cpu / max(1, sum(len(statuses) for statuses in keyless)), 2
                ),
                "keyless_statuses": sorted({status for statuses in keyless for status in statuses}),
            }
        )
    )


def flood(url: str, stop: Any, answered: Any) -> None:
    """Keyless 8 MiB bodies on one connection, one after the other, until `stop`; the statuses go to
    `answered`."""
    body = junk_body(8 * MiB - 1024)
    statuses: list[int] = []
    with httpx.Client(timeout=300) as client:
        while not stop.is_set():
            r = client.post(
                f"{url}/v1/chat/completions", content=body, headers={"content-type": "application/json"}
            )
            statuses.append(r.status_code)
    answered.put(statuses)


def probe(url: str) -> float:
    start = time.perf_counter()
    assert httpx.get(f"{url}/health", timeout=60).status_code == 200
    return (time.perf_counter() - start) * 1000


if __name__ == "__main__":
    main()
