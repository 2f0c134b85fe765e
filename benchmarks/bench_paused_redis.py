"""A step's worst case with a slow Redis: one tenant's stream decodes while 16 requests of another
tenant, whose blocks are all in Redis, arrive at once, and Redis pauses every client for 450 ms over
and over (`CLIENT PAUSE 450`: each read answers just under the tier's 0.5 s timeout, so the tier sees
Redis slow, not down). Reports the longest time a step spent scheduling (its admissions: where the
engine thread used to read the tiers), the longest step (admissions plus the forward pass, whose
prefill chunks of up to 1,024 tokens take seconds on a loaded CPU), the longest gap between the
stream's tokens, and how long the 16 took to their first tokens. The default model, float32 KV.

Run: `python -m benchmarks.bench_paused_redis` (starts its own redis-server); with another checkout's
sources first on PYTHONPATH to compare. `KVSERVE_BENCH_PAUSE_MS` sets the pause (450 by default; on a
loaded machine 300 keeps each read under the 0.5 s timeout), `KVSERVE_BENCH_STEP_TOKENS` the tokens per
step.
"""

import os
import threading
import time

from benchmarks.common import default_model, make_engine, setup_threads
from kvserve.cluster.redis_process import RedisProcess
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.scheduler import ScheduledStep
from kvserve.model.loader import LoadedModel

SECRET = bytes(range(32))
ADMISSIONS = 16
PROMPT_TOKENS = 512
PAUSE_MS = int(os.environ.get("KVSERVE_BENCH_PAUSE_MS", "450"))


def prompts() -> list[list[int]]:
    return [[1000 + (p * 7919 + i * 31) % 30000 for i in range(PROMPT_TOKENS)] for p in range(ADMISSIONS)]


# Tokens per step (the default, 1,024, or less: a smaller budget keeps prefill steps short, so that the
# stream's gaps show the tier's waits). With their blocks loaded, the 16 fit one step's admissions.
STEP_TOKENS = int(os.environ.get("KVSERVE_BENCH_STEP_TOKENS", "1024"))


def engine_on(model: LoadedModel, url: str, step_tokens: int = 1024) -> Engine:
    return make_engine(
        model,
        kv_cache_memory=1024 * 2**20,
        kv_remote=url,
        secret=SECRET,
        max_num_batched_tokens=step_tokens,
    )


def fill(model: LoadedModel, url: str) -> None:
    engine = engine_on(model, url)
    for i, prompt in enumerate(prompts()):
        engine.add_request(f"fill{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv.flush()
    engine.close()


def pause_redis(server: RedisProcess, stop: threading.Event) -> None:
    client = server.client()
    while not stop.is_set():
        client.client_pause(PAUSE_MS)
        stop.wait(PAUSE_MS / 1000)
    client.client_unpause()
    client.close()


def measure(model: LoadedModel, server: RedisProcess) -> dict[str, float]:
    engine = engine_on(model, server.url, STEP_TOKENS)
    stream = SamplingParams(max_tokens=2000, temperature=0.0)
    engine.add_request("stream", [500 + i for i in range(32)], stream)
    while engine.requests["stream"].num_output_tokens < 3:
        engine.step()
    stop = threading.Event()
    pauser = threading.Thread(target=pause_redis, args=(server, stop), daemon=True)
    pauser.start()
    for i, prompt in enumerate(prompts()):
        engine.add_request(f"b{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0), tenant="b")
    # The engine thread's admission work in each step (the old engine read the tiers there).
    longest_schedule = 0.0
    schedule = engine.scheduler.schedule

    def timed_schedule() -> ScheduledStep:
        nonlocal longest_schedule
        t0 = time.monotonic()
        try:
            return schedule()
        finally:
            longest_schedule = max(longest_schedule, time.monotonic() - t0)

    engine.scheduler.schedule = timed_schedule  # type: ignore[method-assign]
    started = last_token = time.monotonic()
    longest_step = longest_gap = 0.0
    waiting = {f"b{i}" for i in range(ADMISSIONS)}
    while waiting:
        t0 = time.monotonic()
        deltas = engine.step()
        now = time.monotonic()
        longest_step = max(longest_step, now - t0)
        for delta in deltas:
            if delta.request_id == "stream" and delta.token_ids:
                longest_gap = max(longest_gap, now - last_token)
                last_token = now
            waiting.discard(delta.request_id)
    all_first = time.monotonic() - started
    stop.set()
    pauser.join()
    stats = engine.stats()
    hits = dict(stats.hits_by_tier)
    engine.abort_request("stream")
    engine.close()
    return {
        "longest_schedule_s": longest_schedule,
        "longest_step_s": longest_step,
        "longest_stream_gap_s": longest_gap,
        "all_16_first_token_s": all_first,
        "redis_hit_tokens": float(hits.get("redis", 0)),
        "prefill_tokens_computed": float(stats.prefill_tokens_computed),
    }


def main() -> None:
    setup_threads()
    model = default_model()
    server = RedisProcess(maxmemory="2gb")
    server.start()
    try:
        fill(model, server.url)
        for key, value in measure(model, server).items():
            print(f"{key}: {value:.2f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
