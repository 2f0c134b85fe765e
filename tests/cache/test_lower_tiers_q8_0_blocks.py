"""q8_0 KV blocks in the lower tiers: the disk tier stores the blocks' own bytes and gives them back
unchanged, a restarted q8_0 engine finds them, and the fingerprint keeps them apart from float16 blocks of
the same model and prompts (neither finds, nor deletes, the other's files); a replica reads another's
q8_0 blocks from Redis."""

from pathlib import Path

import pytest
import torch

from kvserve.cache.disk_tier import DiskTier
from kvserve.engine.engine import Engine
from kvserve.model import kv_quant
from kvserve.model.loader import LoadedModel
from tests.cache.disk_harness import (
    DOCUMENTS,
    SEAL_KEY,
    block_files,
    disk_engine,
    record,
    rounds,
    run_and_check,
)
from tests.harness import assert_cached_kv_is_fresh, engine_with_blocks, greedy
from tests.redis_server import RedisServer

pytestmark = pytest.mark.usefixtures("one_thread")

# Every document's tokens but the last block's partial tail: what a restart finds on disk.
DISK_HITS = len(DOCUMENTS) * 40
HALF = {"kv_dtype": "float16", "attention": "torch"}
Q8 = {"kv_dtype": "q8_0"}


def no_cache(model: LoadedModel, kv: dict[str, str]) -> Engine:
    return engine_with_blocks(model, 512, 16, enable_prefix_caching=False, **kv)


def test_the_tier_stores_and_returns_a_q8_0_blocks_bytes(tmp_path: Path) -> None:
    values = torch.randn(2, 3, 4, 2, 64, generator=torch.Generator().manual_seed(5))
    block = kv_quant.quantize(values)
    assert block.dtype == torch.uint8 and block.shape == (2, 3, 4, 2, 68)
    tier = DiskTier(str(tmp_path), 2**20, b"fp", SEAL_KEY)
    rec = record((1, 2, 3, 4))
    tier.store(rec, block.clone())
    tier.flush()
    (path,) = block_files(tmp_path)
    # The file is the sealed block, not a float copy of it: a header, 34 bytes per 32 values, the seal.
    assert block.numel() < path.stat().st_size < block.numel() + 256
    loaded = DiskTier(str(tmp_path), 2**20, b"fp", SEAL_KEY).load(rec, tuple(block.shape), block.dtype)
    assert loaded is not None and torch.equal(loaded, block)
    tier.close()


def test_a_restarted_q8_0_engine_reads_its_blocks_from_disk(
    tiny_q8_model: LoadedModel, engines: list[Engine], tmp_path: Path
) -> None:
    reference = no_cache(tiny_q8_model, Q8)
    first = disk_engine(tiny_q8_model, tmp_path, engines, num_blocks=128, **Q8)
    run_and_check(first, reference, rounds(1))
    first.close()
    second = disk_engine(tiny_q8_model, tmp_path, engines, num_blocks=128, **Q8)
    run_and_check(second, reference, rounds(1))
    assert second.stats().hits_by_tier["disk"] == DISK_HITS
    # The blocks read back hold exactly the bytes a fresh prefill of their tokens writes.
    assert_cached_kv_is_fresh(second, tiny_q8_model, sample=12)


def test_q8_0_and_float16_blocks_of_one_model_stay_apart(
    tiny_q8_model: LoadedModel, engines: list[Engine], tmp_path: Path
) -> None:
    """Same model, same prompts, one folder: the KV dtype is in the fingerprint, so the chained keys
    differ and neither engine finds the other's blocks (nor takes them for damaged files)."""
    half_reference, q8_reference = no_cache(tiny_q8_model, HALF), no_cache(tiny_q8_model, Q8)
    writer = disk_engine(tiny_q8_model, tmp_path, engines, num_blocks=128, **HALF)
    run_and_check(writer, half_reference, rounds(1))
    writer.close()
    half_files = set(block_files(tmp_path))
    assert half_files
    q8 = disk_engine(tiny_q8_model, tmp_path, engines, num_blocks=128, **Q8)
    run_and_check(q8, q8_reference, rounds(1))
    assert q8.stats().hits_by_tier.get("disk", 0) == 0
    assert q8.kv.usage().tiers[0].loads_failed == 0
    q8.close()
    assert half_files < set(block_files(tmp_path))
    again = disk_engine(tiny_q8_model, tmp_path, engines, num_blocks=128, **HALF)
    run_and_check(again, half_reference, rounds(1))
    assert again.stats().hits_by_tier["disk"] == DISK_HITS


def test_a_replica_reads_another_replicas_q8_0_blocks_from_redis(
    tiny_q8_model: LoadedModel, redis_server: RedisServer
) -> None:
    prompt = [(i * 37) % 4000 + 50 for i in range(70)]
    replicas = [
        engine_with_blocks(tiny_q8_model, 64, 4, kv_remote=redis_server.url, secret=SEAL_KEY, **Q8)
        for _ in range(2)
    ]
    outputs = []
    try:
        for engine in replicas:
            engine.add_request("r", prompt, greedy(6))
            out: list[int] = []
            while engine.has_unfinished_requests():
                for delta in engine.step():
                    out += delta.token_ids
            engine.kv.flush()
            outputs.append(out)
        assert replicas[1].stats().hits_by_tier.get("redis", 0) == (len(prompt) - 1) // 4 * 4
        assert outputs[0] == outputs[1]
        assert_cached_kv_is_fresh(replicas[1], tiny_q8_model, sample=8)
    finally:
        for engine in replicas:
            engine.close()
