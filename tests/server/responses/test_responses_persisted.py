"""Stored responses outlive the process: a server restarted on its --kv-disk folder, and another replica
on the same --kv-remote Redis, continue a conversation by previous_response_id. What is stored is sealed:
a file or value edited, copied under another tenant's name, or sealed under another secret is refused,
never trusted."""

import os
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from kvserve.server.responses.persist import REDIS_PREFIX, DiskBackend, RedisBackend
from tests.helpers import free_port, server_process
from tests.redis_server import RedisServer

SECRET = bytes(range(32))
OTHER_SECRET = bytes(range(100, 132))
DATA = b'{"id": "resp_1", "private": "the conversation"}'


def _respond(url: str, **body: Any) -> dict[str, Any]:
    body = {"temperature": 0, "max_output_tokens": 12, **body}
    reply = httpx.post(f"{url}/v1/responses", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    result: dict[str, Any] = reply.json()
    return result


def test_disk_backend_refuses_what_it_did_not_seal(tmp_path: Path) -> None:
    backend = DiskBackend(str(tmp_path), SECRET, ttl_s=60)
    backend.save("a", "resp_1", DATA, 60)
    assert backend.load("a", "resp_1", 1000) == DATA
    (path,) = Path(backend.directory).iterdir()
    assert b"conversation" not in path.read_bytes() and oct(path.stat().st_mode & 0o777) == "0o600"
    # Under another tenant's name (a copied file), or read with another secret: refused.
    assert backend.load("b", "resp_1", 1000) is None
    other = DiskBackend(str(tmp_path), OTHER_SECRET, ttl_s=60)
    assert other.load("a", "resp_1", 1000) is None
    backend.save("a", "resp_1", DATA, 60)
    (path,) = Path(backend.directory).iterdir()
    target = Path(backend.directory) / (backend._sealed.name("b", "resp_1") + ".resp")
    target.write_bytes(path.read_bytes())
    os.chmod(target, 0o600)
    assert backend.load("b", "resp_1", 1000) is None and not target.exists()
    # Edited: refused and deleted.
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert backend.load("a", "resp_1", 1000) is None and not path.exists()
    # Larger than a stored response may be: not read.
    backend.save("a", "resp_1", DATA, 60)
    assert backend.load("a", "resp_1", 8) is None


def test_redis_backend_refuses_what_it_did_not_seal(redis_session: RedisServer) -> None:
    backend = RedisBackend(redis_session.url, SECRET)
    backend.save("a", "resp_2", DATA, 60)
    assert backend.load("a", "resp_2", 1000) == DATA
    client = redis_session.client()
    (key,) = client.keys(REDIS_PREFIX + b"*")
    value = client.get(key)
    assert isinstance(value, bytes) and b"conversation" not in value and 0 < client.ttl(key) <= 60
    assert backend.load("b", "resp_2", 1000) is None
    assert RedisBackend(redis_session.url, OTHER_SECRET).load("a", "resp_2", 1000) is None
    client.setrange(key, 20, b"\x00\x01")
    assert backend.load("a", "resp_2", 1000) is None
    client.set(key, b"x" * 10_000)
    assert backend.load("a", "resp_2", 1000) is None
    backend.delete("a", "resp_2")
    assert client.keys(REDIS_PREFIX + b"*") == []


def test_a_restarted_server_continues_a_stored_conversation(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "kvserve", "serve", "--port", str(port), "--max-model-len", "1024"]
    argv += ["--kv-cache-memory", "64MiB", "--kv-disk", str(tmp_path / "kv")]
    with server_process(argv, port) as (process, url):
        first = _respond(url, input="What is the capital of France?", instructions="Be brief.")
        second = _respond(
            url, input="And of Italy?", instructions="Be brief.", previous_response_id=first["id"]
        )
        process.kill()
        process.wait()
    with server_process(argv, port) as (process, url):
        assert httpx.get(f"{url}/v1/responses/{first['id']}", timeout=60).json() == first
        again = _respond(
            url, input="And of Italy?", instructions="Be brief.", previous_response_id=first["id"]
        )
        assert again["output"][0]["content"][0]["text"] == second["output"][0]["content"][0]["text"]
        assert again["usage"]["input_tokens"] == second["usage"]["input_tokens"]
        # The stored prompt and reply were found on disk, as ids and as KV.
        assert again["usage"]["input_tokens_details"]["cached_tokens"] > 0
        stored = tmp_path / "kv" / "responses"
        files = len(list(stored.iterdir()))
        assert httpx.delete(f"{url}/v1/responses/{first['id']}", timeout=60).status_code == 200
        assert len(list(stored.iterdir())) == files - 1


def test_another_replica_continues_through_redis(
    make_engine: Callable[..., Engine],
    serve_app: Callable[[FastAPI], AbstractContextManager[str]],
    redis_session: RedisServer,
) -> None:
    def replica() -> FastAPI:
        engine = make_engine(
            kv_cache_memory=64 * 2**20, max_model_len=1024, kv_remote=redis_session.url, secret=SECRET
        )
        return create_app(AsyncEngine(engine), ServerOptions())

    with serve_app(replica()) as url_a, serve_app(replica()) as url_b:
        first = _respond(url_a, input="What is the capital of France?")
        on_a = _respond(url_a, input="And of Italy?", previous_response_id=first["id"])
        on_b = _respond(url_b, input="And of Italy?", previous_response_id=first["id"])
        assert on_b["output"][0]["content"][0]["text"] == on_a["output"][0]["content"][0]["text"]
        assert on_b["usage"]["input_tokens"] == on_a["usage"]["input_tokens"]
        assert httpx.get(f"{url_b}/v1/responses/{on_a['id']}", timeout=60).json() == on_a
