"""The cache folder, the tenant secret and the native kernels' folder are private: created 0700/0600 and
atomically, refused (with a message saying what to do) when a symlink, another user's, or open to others;
a bad secret is a clear startup error."""

import os
import secrets as stdlib_secrets
import stat
from pathlib import Path

import pytest

from kvserve.errors import KVServeError
from kvserve.server.http.tenants import load_or_create_secret

SECRET = "tenant-secret"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_the_secret_is_created_private_and_kept(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    secret = load_or_create_secret(str(cache))
    assert mode(cache) == 0o700 and mode(cache / SECRET) == 0o600
    assert load_or_create_secret(str(cache)) == secret and len(secret) == 32
    assert [p.name for p in cache.iterdir()] == [SECRET]  # no temporary left behind


def test_a_crash_while_creating_the_secret_leaves_no_empty_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The secret is written under a temporary name and then linked into place: a crash half way leaves
    nothing that blocks the next start."""

    def crash(n: int) -> str:
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(stdlib_secrets, "token_hex", crash)
        with pytest.raises(KeyboardInterrupt):
            load_or_create_secret(str(tmp_path))
    assert len(load_or_create_secret(str(tmp_path))) == 32


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty"),
        (b"  \n", "empty"),
        (b"not hex at all\n", "hex"),
        (b"abc\n", "hex"),
        (b"ab" * 8, "fewer"),
    ],
)
def test_a_bad_secret_is_a_clear_startup_error(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / SECRET
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(KVServeError, match=message) as error:
        load_or_create_secret(str(tmp_path))
    assert "delete it" in str(error.value)


def test_a_secret_open_to_others_or_a_symlink_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    load_or_create_secret(str(cache))
    (cache / SECRET).chmod(0o644)
    with pytest.raises(KVServeError, match="chmod 600"):
        load_or_create_secret(str(cache))
    (cache / SECRET).chmod(0o600)
    elsewhere = tmp_path / "elsewhere"
    (cache / SECRET).rename(elsewhere)
    (cache / SECRET).symlink_to(elsewhere)
    with pytest.raises(KVServeError, match="symlink"):
        load_or_create_secret(str(cache))


def test_a_cache_folder_that_is_a_symlink_or_open_to_others_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(KVServeError, match="symlink"):
        load_or_create_secret(str(link))
    real.chmod(0o777)
    with pytest.raises(KVServeError, match="chmod 700"):
        load_or_create_secret(str(real))
    # Readable but not writable by others (an older version's folder): tightened, not refused.
    real.chmod(0o755)
    load_or_create_secret(str(real))
    assert mode(real) == 0o700


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_another_users_secret_or_folder_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    load_or_create_secret(str(cache))
    os.chown(cache / SECRET, 65534, 65534)
    with pytest.raises(KVServeError, match="belongs to user id 65534"):
        load_or_create_secret(str(cache))
    os.chown(cache / SECRET, 0, 0)
    os.chown(cache, 65534, 65534)
    with pytest.raises(KVServeError, match="belongs to user id 65534"):
        load_or_create_secret(str(cache))


def test_the_kernels_folder_is_private_and_a_planted_library_is_never_loaded(tmp_path: Path) -> None:
    """The kernels' .so files are loaded into the server with ctypes: their folder gets the cache
    folder's checks, and a library that is not private is rebuilt rather than loaded."""
    from kvserve.model.native_attention import KernelUnavailableError, load_library

    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (cache / "kernels").symlink_to(elsewhere)
    with pytest.raises(KernelUnavailableError, match="symlink"):
        load_library(str(cache))
    assert not list(elsewhere.iterdir())

    (cache / "kernels").unlink()
    load_library(str(cache))
    [library] = (cache / "kernels").iterdir()
    assert mode(cache / "kernels") == 0o700 and mode(library) == 0o600
    # Something else in the library's place, open to others: rebuilt, not loaded.
    library.unlink()
    library.write_bytes(b"not a library")
    library.chmod(0o666)
    load_library(str(cache))
    assert mode(library) == 0o600 and library.read_bytes().startswith(b"\x7fELF")
