"""A real redis-server on a free loopback port, persistence off, for the Redis tier's tests.

Debian's package provides it (`make deps` installs it when missing); the tests never stand in a fake.
"""

from kvserve.cluster.redis_process import RedisProcess


class RedisServer(RedisProcess):
    def __init__(self) -> None:
        super().__init__(maxmemory="256mb")
