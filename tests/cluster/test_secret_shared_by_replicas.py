"""--tenant-secret-file: replicas given one secret file derive one namespace per tenant (and one sealing key
for the Redis tier); --kv-remote without it refuses to start, saying why."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.secret import SecretError, load_or_create_secret, read_secret
from kvserve.server.http.tenants import Tenant, Tenants
from tests.cluster.cluster_harness import secret_file


def test_two_servers_with_one_secret_file_give_a_tenant_one_namespace(tmp_path: Path) -> None:
    shared = secret_file(tmp_path / "secret")
    alice = Tenant("alice")
    a = Tenants(read_secret(shared))
    b = Tenants(read_secret(shared))
    assert a.namespace(alice) == b.namespace(alice)
    assert a.namespace(alice) != a.namespace(Tenant("bob"))
    # Each server's own secret (no file): another namespace on each.
    own_a = Tenants(load_or_create_secret(str(tmp_path / "a")))
    own_b = Tenants(load_or_create_secret(str(tmp_path / "b")))
    assert own_a.namespace(alice) != own_b.namespace(alice)


def test_a_missing_or_public_secret_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SecretError, match="does not exist"):
        read_secret(str(tmp_path / "nothing"))
    public = secret_file(tmp_path / "public")
    os.chmod(public, 0o644)
    with pytest.raises(SecretError, match="chmod 600"):
        read_secret(public)


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "KVSERVE_TENANT_SECRET_FILE"}
    return subprocess.run(
        [sys.executable, "-m", "kvserve", "serve", "--kv-remote", "redis://127.0.0.1:1/0", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**environ, **(env or {})},
    )


def test_kv_remote_without_a_secret_file_refuses_to_start() -> None:
    result = _serve()
    assert result.returncode == 2
    assert "--kv-remote needs --tenant-secret-file" in result.stderr
    assert "namespace" in result.stderr


def test_the_secret_file_comes_from_the_environment_too(tmp_path: Path) -> None:
    # Named by the variable and missing: the server reads that file (and refuses), not its own secret.
    missing = str(tmp_path / "shared-secret")
    result = _serve(env={"KVSERVE_TENANT_SECRET_FILE": missing})
    assert result.returncode == 2
    assert f"{missing} does not exist" in result.stderr
