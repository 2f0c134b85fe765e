"""The cluster's Redis is closed by default: a client without the password can run nothing, the replicas'
user cannot reconfigure, dump or wipe it, the password is on no command line nor in its configuration
file, and a Redis restarted with another password is to a replica what a down Redis is: misses and
counted errors, never a failure."""

import os
import stat
from collections.abc import Iterator

import pytest
import redis

from kvserve.cache.redis_tier import RedisTier
from kvserve.cluster.redis_process import RedisProcess
from tests.redis_blocks import SECRET, load_run, records, store_all


@pytest.fixture(scope="module")
def closed_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    server = RedisProcess(maxmemory="64mb", run_dir=str(tmp_path_factory.mktemp("redis") / "conf"))
    server.start()
    yield server
    server.stop()


def test_the_clusters_redis_refuses_a_client_without_its_password(closed_redis: RedisProcess) -> None:
    anonymous = redis.Redis(host=closed_redis.host, port=closed_redis.port, socket_timeout=5)
    with pytest.raises(redis.RedisError, match=r"(?i)auth"):
        anonymous.set("kvserve:planted", b"x")
    wrong = redis.Redis(host="127.0.0.1", port=closed_redis.port, username="kvserve", password="guessed")
    with pytest.raises(redis.AuthenticationError):
        wrong.mget(["kvserve:a"])
    # The replicas' URL without the password (what may be shown) opens nothing either.
    with pytest.raises(redis.RedisError):
        redis.Redis.from_url(closed_redis.public_url, socket_timeout=5).dbsize()


@pytest.mark.parametrize(
    "command",
    [
        ("CONFIG", "SET", "maxmemory", "0"),
        ("CONFIG", "GET", "requirepass"),
        ("SAVE",),
        ("BGSAVE",),
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("DEBUG", "SLEEP", "0"),
        ("MODULE", "LIST"),
        ("ACL", "LIST"),
        ("SHUTDOWN", "NOSAVE"),
    ],
)
def test_the_replicas_user_cannot_reconfigure_dump_or_wipe_redis(
    closed_redis: RedisProcess, command: tuple[str, ...]
) -> None:
    replica = redis.Redis.from_url(closed_redis.url, socket_timeout=5)
    try:
        replica.set("kvserve:kept", b"v")
        with pytest.raises(redis.ResponseError):
            replica.execute_command(*command)  # type: ignore[no-untyped-call]
        # What the tier needs still works, and nothing was wiped.
        assert replica.mget(["kvserve:kept", "kvserve:absent"]) == [b"v", None]
        assert replica.dbsize() >= 1
    finally:
        replica.close()


def test_the_redis_password_is_on_no_command_line_nor_in_the_config_file(closed_redis: RedisProcess) -> None:
    assert closed_redis.process is not None
    with open(f"/proc/{closed_redis.process.pid}/cmdline", "rb") as f:
        argv = f.read()
    assert closed_redis.password.encode() not in argv
    assert closed_redis.run_dir is not None
    config = os.path.join(closed_redis.run_dir, "redis.conf")
    assert stat.S_IMODE(os.stat(closed_redis.run_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(config).st_mode) == 0o600
    with open(config) as f:
        text = f.read()
    assert closed_redis.password not in text
    assert "user default off" in text and "protected-mode yes" in text


def test_a_redis_restarted_with_another_password_is_a_down_redis() -> None:
    first = RedisProcess(maxmemory="64mb")
    first.start()
    tier = RedisTier(first.url, SECRET, timeout_s=0.2)
    run = records("ns", list(range(16)))
    second = RedisProcess(port=first.port, maxmemory="64mb")
    try:
        store_all(tier, run)
        assert len(load_run(tier, run)) == len(run)
        first.stop()
        # Another Redis on the same address, another password: every call the replica makes is refused.
        second.start()
        for _ in range(5):
            assert load_run(tier, run) == []
        store_all(tier, run)
        usage = tier.usage()
        assert usage.errors >= 1
        assert usage.misses >= 1
        assert usage.loads == len(run)
        assert second.client().dbsize() == 0
    finally:
        tier.close()
        first.stop()
        second.stop()
