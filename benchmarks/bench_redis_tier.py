"""Throughput of the Redis tier on loopback: stores through the writer thread (pipelined SETs) and
loads of one admission's run of blocks by chunks of several sizes, for the default model's blocks; and
the cost of sealing and opening one block (AES-256-GCM, as both the disk and Redis tiers do), beside
that of the HMAC-SHA256 the tiers computed before they sealed.

Run: `make bench-redis` (writes benchmarks/results/redis_tier.{json,md}); starts its own redis-server.
"""

import hashlib
import hmac
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.common import default_model, make_engine, write_results
from kvserve.cache.block_key import ROOT, chain_key
from kvserve.cache.redis_tier import RedisTier
from kvserve.cache.tiers import BlockRecord
from kvserve.cache.write_behind import payload_bytes
from kvserve.cluster.redis_process import RedisProcess
from kvserve.model.fingerprint import model_fingerprint

BLOCKS = 128
CHUNKS = (1, 4, 8, 16, 32, BLOCKS)
REPEATS = 3
# Seals (and opens) of one block per timing of the sealing cost.
SEALS = 200
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


def per_block_s(work: Callable[[], object]) -> float:
    """Median over REPEATS of the seconds one call of `work` takes, timed over SEALS calls."""
    times: list[float] = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        for _ in range(SEALS):
            work()
        times.append((time.perf_counter() - started) / SEALS)
    return statistics.median(times)


def seal_cost(tier: RedisTier, record: BlockRecord, kv: torch.Tensor) -> dict[str, float]:
    """Seconds per block: the tier's own sealing of a value and opening of it, and HMAC-SHA256 over the
    same bytes (what verifying a block cost before the tiers sealed)."""
    name = tier.redis_key(record.key)
    value = bytes(tier.encode(record, kv))
    shape, dtype = tuple(kv.shape), kv.dtype
    assert torch.equal(tier.decode(name, value, shape, dtype), kv)
    payload = payload_bytes(kv)
    mac_key = bytes(32)
    return {
        "seal_s": per_block_s(lambda: tier.encode(record, kv)),
        "open_s": per_block_s(lambda: tier.decode(name, value, shape, dtype)),
        "hmac_s": per_block_s(lambda: hmac.new(mac_key, payload, hashlib.sha256).digest()),
    }


def main() -> None:
    model = default_model()
    engine = make_engine(model, kv_cache_memory=64 * 2**20)
    io = engine.runner.kv_cache
    shape, dtype = io.block_shape(), io.dtype
    block_size = engine.config.block_size
    config = engine.config
    fingerprint = model_fingerprint(
        model, config.weight_dtype, config.activations, block_size, config.kv_cache_dtype
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
        tier = RedisTier(redis_server.url, SECRET)
        results["seal"] = seal = seal_cost(tier, run[0], kv)
        tier.close()
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
        label = "one read of all" if int(chunk) == BLOCKS else f"reads by chunks of {chunk}"
        lines.append(f"| load, {label} | {BLOCKS / t:.0f} | {mib / t:.0f} | {1000 * t / BLOCKS:.2f} |")
    lines += [
        "",
        f"Sealing one block ({block_bytes} bytes), median of {REPEATS} timings of {SEALS}:",
        "",
        "| operation | µs per block | GB/s |",
        "|---|---:|---:|",
    ]
    for label, key in (
        ("seal (AES-256-GCM, the tier's encode)", "seal_s"),
        ("open (AES-256-GCM, the tier's decode)", "open_s"),
        ("HMAC-SHA256 (what the tiers computed before sealing)", "hmac_s"),
    ):
        t = seal[key]
        lines.append(f"| {label} | {1e6 * t:.0f} | {block_bytes / t / 1e9:.2f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    write_results("redis_tier", results, table)


if __name__ == "__main__":
    main()
