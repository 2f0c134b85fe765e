"""Values in Redis of any size but a block's are refused without being read: whoever can write Redis
can put a value of hundreds of MiB under a block's name, and a read of it whole would stall the
admission and swell the process. Nothing bigger than a block's value crosses the socket; the blocks
beside them still load, and nothing counts as a Redis error."""

from kvserve.cache.redis_tier import RedisTier
from tests.redis_blocks import SECRET, load_run, records, store_all
from tests.redis_server import RedisServer

OVERSIZED_BYTES = 4 * 2**20
# What Redis sends besides the values read: replies' framing and an INFO reply.
SLACK_BYTES = 64 * 2**10


def _bytes_sent(redis_server: RedisServer) -> int:
    client = redis_server.client()
    try:
        return int(client.info("stats")["total_net_output_bytes"])
    finally:
        client.close()


def test_oversized_values_are_misses_and_never_read_whole(redis_server: RedisServer) -> None:
    run = records("ns", list(range(64)))
    writer = RedisTier(redis_server.url, SECRET)
    reader = RedisTier(redis_server.url, SECRET, chunk_blocks=8)
    client = redis_server.client()
    try:
        store_all(writer, run)
        block_value = len(client.get(writer.redis_key(run[0].key)) or b"")
        # The first six blocks of the first chunk: the reader's one read of that chunk meets them all.
        for r in run[:6]:
            client.set(writer.redis_key(r.key), b"\x5a" * OVERSIZED_BYTES)
        before = _bytes_sent(redis_server)
        assert load_run(reader, run) == []
        sent = _bytes_sent(redis_server) - before
        assert sent < reader.chunk_blocks * block_value + SLACK_BYTES, f"{sent} bytes read"
        usage = reader.usage()
        assert (usage.loads, usage.loads_failed, usage.errors) == (0, 6, 0)
        # The whole blocks read with them are good.
        assert len(load_run(reader, run[6:])) == len(run) - 6
    finally:
        client.close()
        writer.close()
        reader.close()


def test_a_key_of_another_type_is_a_refused_value_not_a_redis_error(redis_server: RedisServer) -> None:
    run = records("ns", list(range(16)))
    writer = RedisTier(redis_server.url, SECRET)
    reader = RedisTier(redis_server.url, SECRET)
    client = redis_server.client()
    try:
        store_all(writer, run)
        name = writer.redis_key(run[1].key)
        client.delete(name)
        client.rpush(name, b"not a block")
        assert len(load_run(reader, run)) == 1
        usage = reader.usage()
        assert (usage.loads, usage.loads_failed, usage.errors) == (1, 1, 0)
        # The tier did not back off: the blocks after it load at once.
        assert len(load_run(reader, run[2:])) == len(run) - 2
    finally:
        client.close()
        writer.close()
        reader.close()
