"""A step's worst case with a slow Redis: one tenant's stream decodes while 16 requests of another
tenant, whose blocks are all in Redis, arrive at once, and Redis pauses every client for 450 ms over
and over (`CLIENT PAUSE 450`: each read answers just under the tier's 0.5 s timeout, so the tier sees
Redis slow, not down). Reports the longest step, the longest gap between the stream's tokens, and how
long the 16 took to their first tokens. The default model, float32 KV.

Run: `python -m benchmarks.bench_paused_redis` (starts its own redis-server); with another checkout's
sources first on PYTHONPATH to compare.
"""

import threading
import time

from benchmarks.common import default_model, make_engine, setup_threads
from kvserve.cluster.redis_process import RedisProcess
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.loader import LoadedModel

SECRET = bytes(range(32))
ADMISSIONS = 16
PROMPT_TOKENS = 512
PAUSE_MS = 450


def prompts() -> list[list[int]]:
    return [[1000 + (p * 7919 + i * 31) % 30000 for i in range(PROMPT_TOKENS)] for p in range(ADMISSIONS)]


def engine_on(model: LoadedModel, url: str) -> Engine:
    return make_engine(
        model,
        kv_cache_memory=1024 * 2**20,
        kv_remote=url,
        secret=SECRET,
        max_num_seqs=32,
        max_num_batched_tokens=ADMISSIONS * PROMPT_TOKENS,
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
    engine = engine_on(model, server.url)
    stream = SamplingParams(max_tokens=2000, temperature=0.0)
    engine.add_request("stream", [500 + i for i in range(32)], stream)
    while engine.requests["stream"].num_output_tokens < 3:
        engine.step()
    stop = threading.Event()
    pauser = threading.Thread(target=pause_redis, args=(server, stop), daemon=True)
    pauser.start()
    for i, prompt in enumerate(prompts()):
        engine.add_request(f"b{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0), tenant="b")
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
    hits = dict(engine.stats().hits_by_tier)
    engine.abort_request("stream")
    engine.close()
    return {
        "longest_step_s": longest_step,
        "longest_stream_gap_s": longest_gap,
        "all_16_first_token_s": all_first,
        "redis_hit_tokens": float(hits.get("redis", 0)),
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
