"""Throughput of the Redis tier on loopback: stores through the writer thread (pipelined SETs) and
loads of one admission's run of blocks by MGET chunks of several sizes, for the default model's blocks.

Run: `make bench-redis` (writes benchmarks/results/redis_tier.{json,md}); starts its own redis-server.
"""

import statistics
import time

import torch

from benchmarks.common import default_model, make_engine, write_results
from kvserve.cache.block_key import ROOT, chain_key
from kvserve.cache.redis_tier import RedisTier
from kvserve.cache.tiers import BlockRecord
from kvserve.cluster.redis_process import RedisProcess
from kvserve.model.fingerprint import model_fingerprint

BLOCKS = 128
CHUNKS = (1, 4, 8, 16, 32, BLOCKS)
REPEATS = 3
SECRET = bytes(range(32))


def run_of(fingerprint: bytes, block_size: int, n: int) -> list[BlockRecord]:
    out: list[BlockRecord] = []
    parent = ROOT
    for j in range(n):
        tokens = tuple(range(j * block_size, (j + 1) * block_size))
        key = chain_key(fingerprint, "bench", parent, tokens)
        out.append(BlockRecord(key, parent, "bench", tokens))
        parent = key
    return out


def load_all(tier: RedisTier, run: list[BlockRecord], shape: tuple[int, ...], dtype: torch.dtype) -> int:
    tier.prefetch(run, shape, dtype)
    loaded = 0
    for r in run:
        if not tier.contains(r.key) or tier.load(r, shape, dtype) is None:
            break
        loaded += 1
    tier.prefetch([], shape, dtype)
    return loaded


def main() -> None:
    model = default_model()
    engine = make_engine(model, kv_cache_memory=64 * 2**20)
    io = engine.runner.kv_cache
    shape, dtype = io.block_shape(), io.dtype
    block_size = engine.config.block_size
    config = engine.config
    fingerprint = model_fingerprint(
        model, config.weight_dtype, config.decode_activations, block_size, config.kv_cache_dtype
    )
    block_bytes = io.read_block(0).numel() * dtype.itemsize
    engine.close()
    redis_server = RedisProcess(maxmemory="2gb")
    redis_server.start()
    results: dict[str, object] = {"block_bytes": block_bytes, "blocks": BLOCKS, "block_tokens": block_size}
    try:
        run = run_of(fingerprint, block_size, BLOCKS)
        kv = torch.randn(shape).to(dtype)
        store_s: list[float] = []
        for _ in range(REPEATS):
            redis_server.client().flushall()
            tier = RedisTier(redis_server.url, SECRET, queue_bytes=2 * BLOCKS * block_bytes)
            started = time.perf_counter()
            for r in run:
                tier.store(r, kv)
            tier.flush()
            store_s.append(time.perf_counter() - started)
            assert tier.usage().stores == BLOCKS, tier.usage()
            tier.close()
        results["store_s"] = statistics.median(store_s)
        loads: dict[str, float] = {}
        for chunk in CHUNKS:
            tier = RedisTier(redis_server.url, SECRET, chunk_blocks=chunk, timeout_s=10)
            times: list[float] = []
            for _ in range(REPEATS):
                started = time.perf_counter()
                assert load_all(tier, run, shape, dtype) == BLOCKS
                times.append(time.perf_counter() - started)
            tier.close()
            loads[str(chunk)] = statistics.median(times)
        results["load_s_by_chunk"] = loads
    finally:
        redis_server.stop()
    mib = BLOCKS * block_bytes / 2**20
    lines = [
        f"Redis tier on loopback: {BLOCKS} blocks of {block_size} tokens, {block_bytes / 2**10:.0f} KiB each "
        f"({mib:.0f} MiB), median of {REPEATS}.",
        "",
        "| operation | blocks/s | MiB/s | ms per block |",
        "|---|---:|---:|---:|",
    ]
    s = float(results["store_s"])  # type: ignore[arg-type]
    row = f"{BLOCKS / s:.0f} | {mib / s:.0f} | {1000 * s / BLOCKS:.2f}"
    lines.append(f"| store (writer, pipelined SETs of 16) | {row} |")
    for chunk, t in loads.items():
        label = "one MGET of all" if int(chunk) == BLOCKS else f"MGET chunks of {chunk}"
        lines.append(f"| load, {label} | {BLOCKS / t:.0f} | {mib / t:.0f} | {1000 * t / BLOCKS:.2f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    write_results("redis_tier", results, table)


if __name__ == "__main__":
    main()
