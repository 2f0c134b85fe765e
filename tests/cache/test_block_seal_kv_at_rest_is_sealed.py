"""KV at rest is sealed: whoever copies the disk folder or reads Redis without the secret gets no KV back
(layer 0's V alone would give the prompt back to anyone with the model), and a server with another
secret gets only misses. A sealed value opens only under its key, for its name and header, unchanged;
blocks of the previous, MAC'd format are refused as misses, not served and not a crash."""

import hashlib
import hmac
import json
import logging
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.cache.block_seal import NONCE_BYTES, OVERHEAD, BlockSeal, Unsealable
from kvserve.cache.disk_tier import MAGIC, DiskTier
from kvserve.cache.redis_tier import RedisTier
from kvserve.engine.engine import Engine
from kvserve.model.loader import LoadedModel
from kvserve.secret import DISK_TIER_SEAL_PURPOSE, derive_key
from tests.cache.disk_harness import (
    BLOCK,
    SEAL_KEY,
    block_files,
    disk_engine,
    kv,
    record,
    rounds,
    run_and_check,
)
from tests.harness import engine_with_blocks, greedy
from tests.redis_blocks import DTYPE, SECRET, SHAPE, kv_of, load_run, records, store_all
from tests.redis_server import RedisServer

OTHER_SECRET = bytes(range(100, 132))
DISK_SHAPE = (2, 2, BLOCK, 2, 8)
# The length of the runs of plain KV looked for in stored bytes: long enough never to match by chance.
RUN = 64


def plain_runs(block: torch.Tensor) -> list[bytes]:
    """Every aligned run of RUN bytes of a block's KV, as a tier is handed it (`KVCache.read_block`)."""
    data = block.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return [data[i : i + RUN] for i in range(0, len(data) - RUN + 1, RUN)]


def assert_holds_no_plain_kv(stored: bytes, blocks: list[torch.Tensor]) -> None:
    assert blocks
    leaked = sum(run in stored for block in blocks for run in plain_runs(block))
    assert leaked == 0, f"{leaked} runs of {RUN} bytes of plain KV in the stored bytes"


def memory_blocks(engine: Engine) -> list[torch.Tensor]:
    """The KV of every full block the engine holds in memory: each was handed to its lower tiers."""
    cache = engine.kv.prefix_cache
    assert cache is not None
    io = engine.runner.kv_cache
    return [io.read_block(block) for _, path, block in cache.entries() if len(path) % BLOCK == 0]


# The sealing itself.

SEAL = BlockSeal(SEAL_KEY)
NAME = bytes(range(32))
HEADER = b"HEAD" + json.dumps({"version": 3, "shape": [2, 4]}, separators=(",", ":")).encode()
EDITED = HEADER.replace(b"[2,4]", b"[4,2]")
PAYLOAD = bytes(range(256)) * 4


def test_a_sealed_value_opens_with_its_key_name_and_header_and_shows_nothing() -> None:
    sealed = SEAL.seal(NAME, HEADER, PAYLOAD)
    assert len(sealed) == len(HEADER) + len(PAYLOAD) + OVERHEAD
    assert SEAL.open(NAME, HEADER, sealed, len(PAYLOAD)) == PAYLOAD
    assert_holds_no_plain_kv(bytes(sealed), [torch.frombuffer(bytearray(PAYLOAD), dtype=torch.uint8)])
    # A fresh nonce each time: the same block sealed twice shares nothing but its header.
    again = SEAL.seal(NAME, HEADER, PAYLOAD)
    assert again[len(HEADER) :][:NONCE_BYTES] != sealed[len(HEADER) :][:NONCE_BYTES]


REFUSALS: dict[str, Callable[[bytearray], bytearray]] = {
    "another key": lambda sealed: BlockSeal(bytes(32)).open(NAME, HEADER, sealed, len(PAYLOAD)),
    "another name": lambda sealed: SEAL.open(bytes(32), HEADER, sealed, len(PAYLOAD)),
    "the header edited": lambda sealed: SEAL.open(NAME, EDITED, EDITED + sealed[len(HEADER) :], len(PAYLOAD)),
    "another header expected": lambda sealed: SEAL.open(NAME, EDITED, sealed, len(PAYLOAD)),
    "truncated": lambda sealed: SEAL.open(NAME, HEADER, sealed[:-1], len(PAYLOAD)),
    "one byte more": lambda sealed: SEAL.open(NAME, HEADER, sealed + b"\0", len(PAYLOAD)),
}


@pytest.mark.parametrize("attempt", REFUSALS.values(), ids=REFUSALS.keys())
def test_a_sealed_value_does_not_open_otherwise(attempt: Callable[[bytearray], bytearray]) -> None:
    assert EDITED != HEADER
    with pytest.raises(Unsealable):
        attempt(SEAL.seal(NAME, HEADER, PAYLOAD))


@settings(max_examples=200, deadline=None)
@given(offset=st.integers(0, len(HEADER) + len(PAYLOAD) + OVERHEAD - 1), mask=st.integers(1, 255))
def test_any_byte_changed_in_a_sealed_value_is_refused(offset: int, mask: int) -> None:
    sealed = SEAL.seal(NAME, HEADER, PAYLOAD)
    sealed[offset] ^= mask
    with pytest.raises(Unsealable):
        SEAL.open(NAME, HEADER, sealed, len(PAYLOAD))


# The disk tier.


def test_a_block_file_holds_none_of_its_kv_and_opens_only_under_its_key(tmp_path: Path) -> None:
    tier = DiskTier(str(tmp_path), 2**20, b"fp", SEAL_KEY)
    block = record((1, 2, 3, 4))
    tier.store(block, kv(0))
    tier.close()
    [path] = block_files(tmp_path)
    assert_holds_no_plain_kv(path.read_bytes(), [kv(0)])
    other = DiskTier(str(tmp_path), 2**20, b"fp", bytes(32))
    try:
        assert other.contains(block.key)
        assert other.load(block, DISK_SHAPE, torch.float32) is None
        assert other.usage().loads_failed == 1
    finally:
        other.close()


def _previous_format_file(seal_secret: bytes, block_key: bytes, payload: bytes) -> bytes:
    """A block file exactly as the MAC'd format (version 2) wrote it, under the previous purpose's key."""
    header = {
        "version": 2,
        "dtype": "torch.float32",
        "shape": list(DISK_SHAPE),
        "payload_bytes": len(payload),
    }
    encoded = json.dumps(header, separators=(",", ":")).encode()
    head = MAGIC + len(encoded).to_bytes(4, "little") + encoded
    mac_key = derive_key(seal_secret, "kvserve disk tier v2")
    return head + payload + hmac.new(mac_key, block_key + head + payload, hashlib.sha256).digest()


def test_a_block_file_of_the_previous_format_is_a_miss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret = bytes(range(32))
    block = record((5, 6, 7, 8))
    first = DiskTier(str(tmp_path), 2**20, b"fp", derive_key(secret, DISK_TIER_SEAL_PURPOSE))
    path = Path(first._path(block.key))
    first.close()
    path.parent.mkdir(mode=0o700)
    path.write_bytes(_previous_format_file(secret, block.key, kv(1).numpy().tobytes()))
    path.chmod(0o600)
    tier = DiskTier(str(tmp_path), 2**20, b"fp", derive_key(secret, DISK_TIER_SEAL_PURPOSE))
    try:
        assert tier.contains(block.key)
        with caplog.at_level(logging.WARNING, logger="kvserve.cache"):
            assert tier.load(block, DISK_SHAPE, torch.float32) is None
        assert tier.usage().loads_failed == 1
        assert any("dropped block" in r.getMessage() for r in caplog.records)
        assert not path.exists()
    finally:
        tier.close()


@pytest.mark.usefixtures("one_thread")
def test_a_copy_of_the_disk_folder_without_the_secret_gives_back_no_kv(
    tiny_model: LoadedModel, reference: Engine, engines: list[Engine], tmp_path: Path
) -> None:
    engine = disk_engine(tiny_model, tmp_path / "kv", engines)
    run_and_check(engine, reference, rounds(1))
    engine.kv.flush()
    shutil.copytree(tmp_path / "kv", tmp_path / "copy")
    stored = b"".join(p.read_bytes() for p in block_files(tmp_path / "copy"))
    assert_holds_no_plain_kv(stored, memory_blocks(engine))
    # A server with another secret finds the files (their names hold no secret) but opens none.
    other = disk_engine(tiny_model, tmp_path / "copy", engines, secret=OTHER_SECRET)
    run_and_check(other, reference, rounds(1))
    assert other.stats().hits_by_tier.get("disk", 0) == 0
    assert other.kv.usage().tiers[0].loads_failed > 0


# The Redis tier.


def test_a_redis_value_holds_none_of_its_kv_and_opens_only_under_its_secret(
    redis_server: RedisServer,
) -> None:
    writer = RedisTier(redis_server.url, SECRET)
    other = RedisTier(redis_server.url, OTHER_SECRET)
    [block] = records("ns", [7, 8, 9, 10])
    client = redis_server.client()
    try:
        store_all(writer, [block])
        value = client.get(writer.redis_key(block.key))
        assert isinstance(value, bytes)
        assert_holds_no_plain_kv(value, [kv_of(block)])
        # Copied under the name another secret gives the block: found, but it does not open.
        client.set(other.redis_key(block.key), value)
        assert load_run(other, [block]) == []
        assert other.usage().loads_failed == 1
    finally:
        client.close()
        writer.close()
        other.close()


def _previous_format_value(name: bytes, payload: bytes) -> bytes:
    """A value exactly as the MAC'd format (version 1) wrote it, under the previous purpose's key."""
    dtype = str(DTYPE).encode()
    head = (
        b"KVSR"
        + bytes([1, len(dtype)])
        + dtype
        + bytes([len(SHAPE)])
        + struct.pack(f"<{len(SHAPE)}I", *SHAPE)
    )
    mac = hmac.new(derive_key(SECRET, "kvserve redis tier: value mac"), name, hashlib.sha256)
    mac.update(head + payload)
    return head + payload + mac.digest()


def test_a_redis_value_of_the_previous_format_is_refused(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, SECRET)
    [block] = records("ns", [1, 2, 3, 4])
    client = redis_server.client()
    try:
        name = tier.redis_key(block.key)
        client.set(name, _previous_format_value(name, kv_of(block).numpy().tobytes()))
        assert load_run(tier, [block]) == []
        usage = tier.usage()
        assert (usage.loads, usage.loads_failed, usage.errors) == (0, 1, 0)
    finally:
        client.close()
        tier.close()


@pytest.mark.usefixtures("one_thread")
def test_redis_holds_none_of_an_engines_kv(tiny_model: LoadedModel, redis_server: RedisServer) -> None:
    engine = engine_with_blocks(tiny_model, 64, BLOCK, kv_remote=redis_server.url, secret=SECRET)
    client = redis_server.client()
    try:
        engine.add_request("r", [(i * 37) % 4000 + 50 for i in range(70)], greedy(4))
        while engine.has_unfinished_requests():
            engine.step()
        engine.kv.flush()
        names = client.keys("kvserve:*")
        assert names
        stored = b"".join(v for v in client.mget(names) if isinstance(v, bytes))
        assert_holds_no_plain_kv(stored, memory_blocks(engine))
    finally:
        client.close()
        engine.close()
