"""The Redis tier against a real redis-server: blocks round-trip between replicas that share a secret,
values are refused unless their seal opens, foreign keys never match, and Redis down, flushed or
restarted is only ever a miss."""

import struct
import time

import pytest
import torch

from kvserve.cache.block_seal import OVERHEAD
from kvserve.cache.redis_tier import RedisTier
from kvserve.engine.engine import Engine
from kvserve.model.loader import LoadedModel
from tests.harness import engine_with_blocks, greedy
from tests.helpers import free_port
from tests.redis_blocks import DTYPE, FINGERPRINT, SECRET, SHAPE, kv_of, load_run, records, store_all
from tests.redis_server import RedisServer


def test_a_replica_loads_the_blocks_another_stored(redis_server: RedisServer) -> None:
    a = RedisTier(redis_server.url, SECRET, chunk_blocks=3)
    b = RedisTier(redis_server.url, SECRET, chunk_blocks=3)
    run = records("ns", list(range(40)))
    try:
        store_all(a, run)
        assert a.usage().stores == len(run)
        got = load_run(b, run)
        assert len(got) == len(run)
        for r, kv in zip(run, got, strict=True):
            assert torch.equal(kv, kv_of(r))
        assert b.usage().loads == len(run)
    finally:
        a.close()
        b.close()


def test_values_hold_no_token_ids_and_key_names_hide_the_chain_key(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, SECRET)
    [r] = records("ns", [7, 8, 9, 10])
    try:
        store_all(tier, [r])
        client = redis_server.client()
        [name] = client.keys("*")
        assert r.key.hex().encode() not in name
        value = client.get(name)
        assert value is not None
        payload = kv_of(r).numel() * DTYPE.itemsize
        # Magic, version, dtype, shape, nonce, encrypted payload and tag: no room for anything else.
        head = 4 + 2 + len("torch.float32") + 1 + 4 * len(SHAPE)
        assert len(value) == head + payload + OVERHEAD
        assert struct.pack("<4q", *r.tokens) not in value
    finally:
        tier.close()


def test_a_value_rewritten_without_the_secret_is_refused(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, SECRET)
    run = records("ns", list(range(12)))
    try:
        store_all(tier, run)
        client = redis_server.client()
        name = tier.redis_key(run[1].key)
        value = bytearray(client.get(name) or b"")  # type: ignore[arg-type]
        value[100] ^= 1
        client.set(name, bytes(value))
        # Another block's intact value moved under this name is refused too: the seal binds the name.
        client.set(tier.redis_key(run[2].key), client.get(tier.redis_key(run[0].key)) or b"")
        reader = RedisTier(redis_server.url, SECRET)
        try:
            assert len(load_run(reader, run)) == 1
            assert reader.usage().loads_failed == 2
        finally:
            reader.close()
    finally:
        tier.close()


@pytest.mark.parametrize(
    ("fingerprint", "namespace", "secret"),
    [(b"model-b", "ns", SECRET), (FINGERPRINT, "other", SECRET), (FINGERPRINT, "ns", bytes(32))],
    ids=["another model", "another namespace", "another secret"],
)
def test_foreign_keys_never_match(
    redis_server: RedisServer, fingerprint: bytes, namespace: str, secret: bytes
) -> None:
    tokens = list(range(16))
    writer = RedisTier(redis_server.url, SECRET)
    reader = RedisTier(redis_server.url, secret)
    try:
        store_all(writer, records("ns", tokens))
        assert load_run(reader, records(namespace, tokens, fingerprint=fingerprint)) == []
        usage = reader.usage()
        assert usage.loads == usage.loads_failed == 0
        assert usage.misses > 0
    finally:
        writer.close()
        reader.close()


def test_redis_down_is_a_miss_counted_and_bounded() -> None:
    # Nothing listens on this port: every call fails fast, and the back-off spares the next ones.
    tier = RedisTier(f"redis://127.0.0.1:{free_port()}/0", SECRET, timeout_s=0.2)
    run = records("ns", list(range(40)))
    try:
        started = time.monotonic()
        for _ in range(20):
            assert load_run(tier, run) == []
        assert time.monotonic() - started < 5
        store_all(tier, run)
        usage = tier.usage()
        assert usage.errors >= 1
        assert usage.misses >= 20
        assert usage.stores == 0
        assert usage.stores_dropped == len(run)
    finally:
        tier.close()


def test_a_paused_redis_costs_one_timeout_then_misses(redis_server: RedisServer) -> None:
    run = records("ns", list(range(40)))
    writer = RedisTier(redis_server.url, SECRET)
    reader = RedisTier(redis_server.url, SECRET, timeout_s=0.2, chunk_blocks=2)
    client = redis_server.client()
    try:
        store_all(writer, run)
        # Redis holds every command for 3 s: as slow as a server can be while still up.
        client.client_pause(3000)
        started = time.monotonic()
        assert load_run(reader, run) == []
        assert load_run(reader, run) == []
        assert time.monotonic() - started < 1.5
        assert reader.usage().errors == 1
        client.client_unpause()
    finally:
        client.close()
        writer.close()
        reader.close()


def test_a_slow_redis_stops_an_admission_at_its_budget(redis_server: RedisServer) -> None:
    run = records("ns", list(range(40)))
    writer = RedisTier(redis_server.url, SECRET)
    reader = RedisTier(redis_server.url, SECRET, chunk_blocks=1, admission_budget_s=0.0)
    try:
        store_all(writer, run)
        # A budget that the first read spends: the admission gets one chunk, the rest are misses.
        assert len(load_run(reader, run)) == 1
        usage = reader.usage()
        assert (usage.loads, usage.misses, usage.errors) == (1, 1, 0)
    finally:
        writer.close()
        reader.close()


def test_a_flushed_redis_is_a_miss(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, SECRET)
    run = records("ns", list(range(8)))
    try:
        store_all(tier, run)
        redis_server.client().flushall()
        reader = RedisTier(redis_server.url, SECRET)
        try:
            assert load_run(reader, run) == []
            assert reader.usage().misses >= 1
            assert reader.usage().errors == 0
        finally:
            reader.close()
    finally:
        tier.close()


# Through the engine: the tiny model, greedy, against an engine with no cache at all.

BLOCK = 4


def _engine(model: LoadedModel, url: str, blocks: int = 64, **overrides: object) -> Engine:
    return engine_with_blocks(
        model, blocks, BLOCK, kv_remote=url, secret=SECRET, attention="torch", **overrides
    )


def _generate(engine: Engine, prompt: list[int], max_tokens: int = 6) -> tuple[list[int], dict[str, int]]:
    rid = f"r{time.monotonic_ns()}"
    engine.add_request(rid, prompt, greedy(max_tokens))
    out: list[int] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out += delta.token_ids
    return out, dict(engine.stats().hits_by_tier)


@pytest.fixture(scope="module")
def plain(tiny_model: LoadedModel) -> Engine:
    return engine_with_blocks(tiny_model, 256, BLOCK, enable_prefix_caching=False, attention="torch")


@pytest.mark.usefixtures("one_thread")
def test_engine_b_finds_engine_a_blocks_in_redis(
    tiny_model: LoadedModel, plain: Engine, redis_server: RedisServer
) -> None:
    prompt = [(i * 37) % 4000 + 50 for i in range(70)]
    want, _ = _generate(plain, prompt)
    a = _engine(tiny_model, redis_server.url)
    b = _engine(tiny_model, redis_server.url)
    try:
        got_a, _ = _generate(a, prompt)
        a.kv.flush()
        got_b, hits = _generate(b, prompt)
        assert got_a == got_b == want
        assert hits.get("redis", 0) == (len(prompt) - 1) // BLOCK * BLOCK
    finally:
        a.close()
        b.close()


@pytest.mark.usefixtures("one_thread")
def test_redis_killed_then_restarted_mid_run(tiny_model: LoadedModel, plain: Engine) -> None:
    server = RedisServer()
    server.start()
    engine = _engine(tiny_model, server.url, blocks=24)
    try:
        prompts = [[(i * k) % 4000 + 50 for i in range(30)] for k in (3, 5, 7, 11, 13, 17)]
        for p in prompts[:2]:
            assert _generate(engine, p)[0] == _generate(plain, p)[0]
        engine.kv.flush()
        server.stop()
        # Down: answers stay right; the tier counts its misses and errors and fails nothing.
        for p in prompts[2:4]:
            assert _generate(engine, p)[0] == _generate(plain, p)[0]
        tier = engine.stats().cache.tiers[0]
        assert tier.name == "redis" and tier.errors >= 1
        server.start()
        # Back: after its back-off the tier reconnects, writes again, and another engine reads that.
        deadline = time.monotonic() + 60
        stores_before = tier.stores
        while engine.stats().cache.tiers[0].stores == stores_before:
            assert time.monotonic() < deadline, "the tier never reconnected"
            time.sleep(0.3)
            p = [(i * 19 + int(time.monotonic() * 1000)) % 4000 + 50 for i in range(30)]
            assert _generate(engine, p)[0] == _generate(plain, p)[0]
            engine.kv.flush()
        for p in prompts[4:]:
            assert _generate(engine, p)[0] == _generate(plain, p)[0]
        engine.kv.flush()
        other = _engine(tiny_model, server.url)
        try:
            got, hits = _generate(other, prompts[5])
            assert got == _generate(plain, prompts[5])[0]
            assert hits.get("redis", 0) > 0
        finally:
            other.close()
    finally:
        engine.close()
        server.stop()


@pytest.mark.usefixtures("one_thread")
def test_blocks_recomputed_after_redis_lost_them_are_stored_again(
    tiny_model: LoadedModel, plain: Engine, redis_server: RedisServer
) -> None:
    # Regression: the tier remembered what it had written and never wrote it again, so after Redis
    # was flushed (or restarted, or evicted the keys) a replica's recomputed blocks never came back.
    prompt = [(i * 29) % 4000 + 50 for i in range(40)]
    a = _engine(tiny_model, redis_server.url)
    b = _engine(tiny_model, redis_server.url)
    try:
        _generate(a, prompt)
        a.kv.flush()
        redis_server.client().flushall()
        a.kv.reset_prefix_cache()
        _generate(a, prompt)
        a.kv.flush()
        got, hits = _generate(b, prompt)
        assert got == _generate(plain, prompt)[0]
        assert hits.get("redis", 0) == (len(prompt) - 1) // BLOCK * BLOCK
    finally:
        a.close()
        b.close()
