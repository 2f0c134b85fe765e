"""A configuration the engine, the server or the cluster cannot use stops the real command line with one
line, `kvserve: error: ...`, naming the option, and exit status 2: no traceback."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.cluster.launch import ClusterConfig
from kvserve.config import EngineConfig
from kvserve.errors import ConfigError
from kvserve.options import ServerOptions
from tests.helpers import save_tiny_model


def kvserve(*argv: str, environ: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_")} | (environ or {})
    return subprocess.run(
        [sys.executable, "-m", "kvserve", *argv], capture_output=True, text=True, timeout=300, env=env
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvserve: error: ")
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny") / "llama"), "llama", vocab_size=4096)


def test_a_block_size_that_is_no_power_of_two() -> None:
    assert_one_line_error(kvserve("serve", "--block-size", "24"), "block_size", "power of 2", "24")


def test_a_kv_cache_below_one_block_of_the_model(tiny_model_dir: str) -> None:
    result = kvserve("generate", "--model", tiny_model_dir, "--kv-cache-memory", "1KiB", "Hello")
    assert_one_line_error(result, "1KiB", "below one KV block", "--kv-cache-memory")


def test_native_attention_where_no_compiler_can_build_it(tiny_model_dir: str, tmp_path: Path) -> None:
    result = kvserve(
        "--log-level",
        "warning",
        "generate",
        "--model",
        tiny_model_dir,
        "--attention",
        "native",
        "--weight-dtype",
        "float32",
        "Hello",
        environ={"CC": str(tmp_path / "no-such-compiler"), "KVSERVE_CACHE_DIR": str(tmp_path / "fresh")},
    )
    assert_one_line_error(result, "no-such-compiler")


def test_a_cluster_without_replicas() -> None:
    assert_one_line_error(kvserve("cluster", "--replicas", "0"), "replicas", "at least 1")


def test_a_redis_size_redis_would_refuse() -> None:
    assert_one_line_error(kvserve("cluster", "--redis-maxmemory", "lots"), "redis_maxmemory", "'lots'")


def test_a_cluster_secret_file_that_does_not_exist(tmp_path: Path) -> None:
    missing = str(tmp_path / "shared-secret")
    result = kvserve("cluster", "--tenant-secret-file", missing)
    assert_one_line_error(result, f"{missing} does not exist")


def test_cluster_config_is_frozen_and_validated() -> None:
    config = ClusterConfig(serve_args=["--block-size", "32"])
    assert config.serve_args == ("--block-size", "32")
    with pytest.raises(AttributeError):
        config.replicas = 3  # type: ignore[misc]
    for fields in ({"threads": 0}, {"port": 70000}, {"policy": "fastest"}, {"serve_args": "--x"}):
        with pytest.raises(ConfigError):
            ClusterConfig(**fields)  # type: ignore[arg-type]


def test_engine_config_errors_are_config_errors() -> None:
    for fields in ({"block_size": 0}, {"kv_cache_memory": "2XB"}, {"max_num_seqs": 0}, {"attention": "x"}):
        with pytest.raises(ConfigError):
            EngineConfig(**fields)  # type: ignore[arg-type]


def test_the_engine_and_the_server_refuse_a_redis_tier_without_a_shared_secret_alike() -> None:
    url = "redis://127.0.0.1:6379/0"
    with pytest.raises(ConfigError) as engine:
        EngineConfig(kv_remote=url)
    with pytest.raises(ConfigError) as server:
        ServerOptions(kv_remote=url)
    assert str(engine.value) == str(server.value)
    assert EngineConfig(kv_remote=url, secret=b"s" * 16).kv_remote == url
    with pytest.raises(ConfigError, match="redis://, rediss:// or unix://"):
        EngineConfig(kv_remote="127.0.0.1:6379", secret=b"s" * 16)
