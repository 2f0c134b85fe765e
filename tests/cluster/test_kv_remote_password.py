"""--kv-remote never carries the Redis password, where `ps` would show it: a URL with one is refused with
a one-line message that does not repeat it; the password comes from a private file
(--kv-remote-password-file) or from $KVSERVE_KV_REMOTE_PASSWORD, and the tier connects with it."""

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from kvserve.cache.redis_tier import RedisTier
from kvserve.cluster.redis_process import RedisProcess
from kvserve.config import EngineConfig
from kvserve.credentials import KV_REMOTE_PASSWORD_ENV, read_kv_remote_password, url_with_password
from kvserve.errors import ConfigError
from kvserve.options import ServerOptions
from tests.cluster.cluster_harness import secret_file
from tests.redis_blocks import SECRET, load_run, records, store_all

PASSWORD = "hunter2-Zq9"
URLS_WITH_A_PASSWORD = [
    f"redis://:{PASSWORD}@127.0.0.1:6379/0",
    f"redis://kvserve:{PASSWORD}@10.0.0.5:6379/0",
    f"rediss://kvserve:{PASSWORD}@redis.example:6380/1",
    f"redis://127.0.0.1:6379/0?password={PASSWORD}",
    f"unix://kvserve:{PASSWORD}@/run/redis.sock?db=0",
]


@pytest.mark.parametrize("url", URLS_WITH_A_PASSWORD)
def test_a_kv_remote_url_with_a_password_is_refused_without_repeating_it(tmp_path: Path, url: str) -> None:
    with pytest.raises(ConfigError) as refused:
        ServerOptions(kv_remote=url, tenant_secret_file=secret_file(tmp_path / "secret"))
    message = str(refused.value)
    assert PASSWORD not in message and "\n" not in message
    assert "--kv-remote-password-file" in message and KV_REMOTE_PASSWORD_ENV in message


def test_kvserve_serve_refuses_the_password_on_its_command_line(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "kvserve", "serve", "--kv-remote", URLS_WITH_A_PASSWORD[1]]
    argv += ["--tenant-secret-file", secret_file(tmp_path / "secret")]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert PASSWORD not in result.stderr + result.stdout
    assert result.stderr.startswith("kvserve: error: --kv-remote must not carry a password")
    assert len(result.stderr.strip().splitlines()) == 1


def private_file(path: Path, text: str, mode: int = 0o600) -> str:
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_the_password_comes_from_a_private_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KV_REMOTE_PASSWORD_ENV, raising=False)
    assert read_kv_remote_password(None) is None
    monkeypatch.setenv(KV_REMOTE_PASSWORD_ENV, "from-env")
    assert read_kv_remote_password(None) == "from-env"
    # A file, when given, wins over the variable.
    assert read_kv_remote_password(private_file(tmp_path / "pw", "from-file\n")) == "from-file"
    with pytest.raises(ConfigError, match="chmod 600"):
        read_kv_remote_password(private_file(tmp_path / "public", "x\n", 0o644))
    with pytest.raises(ConfigError, match="one line"):
        read_kv_remote_password(private_file(tmp_path / "two", "a\nb\n"))
    with pytest.raises(ConfigError, match="No such file"):
        read_kv_remote_password(str(tmp_path / "missing"))


def test_the_password_file_needs_kv_remote(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs --kv-remote"):
        ServerOptions(kv_remote_password_file=private_file(tmp_path / "pw", "x\n"))


@given(
    user=st.sampled_from(["", "kvserve", "us%40er"]),
    password=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=40),
)
def test_the_password_reaches_redis_py_as_given(user: str, password: str) -> None:
    at = f"{user}@" if user else ""
    client = redis.Redis.from_url(url_with_password(f"redis://{at}10.0.0.5:6379/3", password))
    parsed = client.connection_pool.connection_kwargs
    assert parsed["password"] == password
    assert parsed.get("username") == (user.replace("%40", "@") or None)
    assert (parsed["host"], parsed["port"], parsed["db"]) == ("10.0.0.5", 6379, 3)


@pytest.fixture(scope="module")
def closed_redis() -> Iterator[RedisProcess]:
    server = RedisProcess(maxmemory="64mb")
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize("source", ["file", "environment"])
def test_a_tier_with_the_password_from_a_file_or_the_environment_reads_what_it_wrote(
    closed_redis: RedisProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    # What `kvserve serve` does with --kv-remote and its password (server/app.py).
    monkeypatch.setenv(KV_REMOTE_PASSWORD_ENV, closed_redis.password)
    path = private_file(tmp_path / "pw", closed_redis.password + "\n") if source == "file" else None
    if path is not None:
        monkeypatch.setenv(KV_REMOTE_PASSWORD_ENV, "not-this-one")
    options = ServerOptions(
        kv_remote=closed_redis.public_url,
        kv_remote_password_file=path,
        tenant_secret_file=secret_file(tmp_path / "secret"),
    )
    assert options.kv_remote is not None
    url = url_with_password(options.kv_remote, read_kv_remote_password(options.kv_remote_password_file))
    tier = RedisTier(url, SECRET)
    run = records(source, list(range(12)))
    try:
        store_all(tier, run)
        assert len(load_run(tier, run)) == len(run)
        assert tier.usage().errors == 0
    finally:
        tier.close()
    # Neither config shows it.
    assert closed_redis.password not in repr(options)
    assert closed_redis.password not in repr(EngineConfig(kv_remote=url, secret=SECRET))
