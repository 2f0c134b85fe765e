"""The disk tier's folder is hostile ground: whatever is found there (arbitrary bytes, truncations,
hostile headers, FIFOs, symlinks, folders, huge sparse files, a file forged without the secret), between
requests or across a restart, the engine never stops, never serves it (outputs equal a no-cache
engine's), and says so in a warning each time. The files hold no token ids, and are private."""

import hashlib
import logging
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.cache.block_seal import NONCE_BYTES, TAG_BYTES
from kvserve.cache.disk_tier import MAGIC, MAX_FILE_BYTES, DiskTier
from kvserve.engine.engine import Engine
from kvserve.model.loader import LoadedModel
from tests.cache.disk_harness import (
    BLOCK,
    DOCUMENTS,
    SEAL_KEY,
    block_files,
    disk_engine,
    kv,
    record,
    rounds,
    run_and_check,
)

pytestmark = pytest.mark.usefixtures("one_thread")

# KVSERVE_LONG_TESTS=1 runs the property below on many more files.
EXAMPLES = 2000 if os.environ.get("KVSERVE_LONG_TESTS") else 150
SHAPE = (2, 2, BLOCK, 2, 8)


def _replace(path: Path, data: bytes) -> None:
    path.unlink()
    path.write_bytes(data)
    path.chmod(0o600)


def _flip(data: bytes, offset: int) -> bytes:
    out = bytearray(data)
    out[offset] ^= 0x5A
    return bytes(out)


def _sparse(path: Path) -> None:
    path.unlink()
    with open(path, "wb") as f:
        f.truncate(max(2**40, MAX_FILE_BYTES + 1))
    path.chmod(0o600)


def _symlink_to_a_copy(path: Path) -> None:
    # Whole and valid, but reached through a symlink: a file elsewhere is never read.
    copy = path.parent.parent.parent / f"elsewhere-{path.name}"
    path.rename(copy)
    path.symlink_to(copy)


# Each: (name, how it damages one block file, given the file and the bytes of another valid one).
Damage = Callable[[Path, bytes], None]
CORPUS: list[tuple[str, Damage]] = [
    ("random bytes, same size", lambda p, o: _replace(p, os.urandom(p.stat().st_size))),
    ("random bytes, short", lambda p, o: _replace(p, os.urandom(100))),
    ("empty", lambda p, o: _replace(p, b"")),
    ("truncated", lambda p, o: _replace(p, p.read_bytes()[: p.stat().st_size // 2])),
    ("one byte more", lambda p, o: _replace(p, p.read_bytes() + b"\0")),
    ("payload byte flipped", lambda p, o: _replace(p, _flip(p.read_bytes(), -TAG_BYTES - 9))),
    ("tag byte flipped", lambda p, o: _replace(p, _flip(p.read_bytes(), -1))),
    ("header byte flipped", lambda p, o: _replace(p, _flip(p.read_bytes(), 20))),
    ("deep nesting", lambda p, o: _replace(p, MAGIC + (100_000).to_bytes(4, "little") + b"[" * 100_000)),
    (
        "deep nesting, same size",
        lambda p, o: _replace(
            p, MAGIC + (p.stat().st_size - 12).to_bytes(4, "little") + b"[" * (p.stat().st_size - 12)
        ),
    ),
    ("huge header length", lambda p, o: _replace(p, MAGIC + b"\xff\xff\xff\xff" + p.read_bytes()[12:])),
    ("another block's valid file", lambda p, o: _replace(p, o)),
    ("open to other users", lambda p, o: p.chmod(0o644)),
    ("FIFO", lambda p, o: (p.unlink(), os.mkfifo(p))),  # type: ignore[list-item, func-returns-value]
    ("symlink to a valid copy", lambda p, o: _symlink_to_a_copy(p)),
    ("huge sparse file", lambda p, o: _sparse(p)),
    # Last: a folder in a block's place stays (it is not ours to remove), so that block is not stored
    # again and the next damage of its file would go unseen.
    ("folder", lambda p, o: (p.unlink(), p.mkdir())),  # type: ignore[list-item, func-returns-value]
]
# Left out of the index at startup, with a warning, without being opened.
SKIPPED_AT_STARTUP = {"FIFO", "folder", "symlink to a valid copy", "huge sparse file"}


def _restore(originals: dict[Path, bytes]) -> None:
    for path, data in originals.items():
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        elif path.exists() or path.is_symlink():
            path.unlink()
        path.write_bytes(data)
        path.chmod(0o600)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "kvserve.cache"
    ]


def _disk_hits(engine: Engine) -> int:
    return engine.stats().hits_by_tier.get("disk", 0)


def test_hostile_files_between_requests_are_misses_with_a_warning(
    tiny_model: LoadedModel,
    reference: Engine,
    engines: list[Engine],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = disk_engine(tiny_model, tmp_path / "kv", engines)
    run_and_check(engine, reference, rounds(1))
    engine.kv.flush()
    originals = {path: path.read_bytes() for path in block_files(tmp_path / "kv")}
    files = sorted(originals)
    for name, damage in CORPUS:
        engine.kv.flush()
        engine.reset_prefix_cache()
        _restore(originals)
        for path in files[:-1]:
            damage(path, originals[files[-1]])
        hits, failed = _disk_hits(engine), engine.kv.usage().tiers[0].loads_failed
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvserve.cache"):
            run_and_check(engine, reference, rounds(1))
        new_failures = engine.kv.usage().tiers[0].loads_failed - failed
        dropped = [m for m in _warnings(caplog) if "dropped block" in m]
        assert new_failures > 0 and len(dropped) == new_failures, name
        # Only the one file left whole may hit, if it holds a document's first block (each document's
        # first block is looked up first): one block, BLOCK tokens (hits are counted in tokens).
        assert _disk_hits(engine) - hits <= BLOCK, name


def test_hostile_files_across_a_restart_are_misses_with_a_warning(
    tiny_model: LoadedModel,
    reference: Engine,
    engines: list[Engine],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    first = disk_engine(tiny_model, tmp_path / "kv", engines)
    run_and_check(first, reference, rounds(1))
    first.close()
    files = block_files(tmp_path / "kv")
    valid = files[-1].read_bytes()
    assert len(files) > 2 * len(CORPUS)
    for i, path in enumerate(files):
        CORPUS[i % len(CORPUS)][1](path, valid)
    with caplog.at_level(logging.WARNING, logger="kvserve.cache"):
        restarted = disk_engine(tiny_model, tmp_path / "kv", engines)
        skipped = [m for m in _warnings(caplog) if "skipped" in m]
        expected = sum(CORPUS[i % len(CORPUS)][0] in SKIPPED_AT_STARTUP for i in range(len(files)))
        assert len(skipped) == expected
        run_and_check(restarted, reference, rounds(1))
    assert _disk_hits(restarted) == 0
    dropped = [m for m in _warnings(caplog) if "dropped block" in m]
    assert dropped and len(dropped) == restarted.kv.usage().tiers[0].loads_failed


def test_a_file_forged_without_the_secret_is_refused(
    tiny_model: LoadedModel, reference: Engine, engines: list[Engine], tmp_path: Path
) -> None:
    """Someone who can write the folder but lacks the secret rewrites a block's KV (zeros) and
    recomputes every integrity field that needs no key: the seal still refuses it."""
    engine = disk_engine(tiny_model, tmp_path, engines)
    run_and_check(engine, reference, rounds(1))
    engine.kv.flush()
    engine.reset_prefix_cache()
    for path in block_files(tmp_path):
        data = path.read_bytes()
        head = 12 + int.from_bytes(data[8:12], "little")
        body = data[: head + NONCE_BYTES] + bytes(len(data) - head - NONCE_BYTES - TAG_BYTES)
        forged = body + hashlib.sha256(bytes.fromhex(path.stem) + body).digest()[:TAG_BYTES]
        _replace(path, forged)
    hits = _disk_hits(engine)
    run_and_check(engine, reference, rounds(1))
    assert _disk_hits(engine) == hits


def test_block_files_hold_no_token_ids(
    tiny_model: LoadedModel, reference: Engine, engines: list[Engine], tmp_path: Path
) -> None:
    """Any local user able to read a file must not rebuild the prompt from it: the key (a hash) binds
    the tokens instead."""
    engine = disk_engine(tiny_model, tmp_path, engines)
    run_and_check(engine, reference, rounds(1))
    engine.kv.flush()
    files = block_files(tmp_path)
    assert files
    contents = b"".join(p.read_bytes() for p in files)
    for document in DOCUMENTS:
        for j in range(0, len(document), BLOCK):
            tokens = document[j : j + BLOCK]
            assert ",".join(map(str, tokens)).encode() not in contents
            assert b"".join(t.to_bytes(8, "little") for t in tokens) not in contents
            assert b"".join(t.to_bytes(4, "little") for t in tokens) not in contents


def test_the_folder_and_files_are_private(
    tiny_model: LoadedModel, reference: Engine, engines: list[Engine], tmp_path: Path
) -> None:
    old_umask = os.umask(0)
    try:
        engine = disk_engine(tiny_model, tmp_path / "kv", engines)
        run_and_check(engine, reference, rounds(1))
        engine.kv.flush()
    finally:
        os.umask(old_umask)
    folders = [tmp_path / "kv", *{p.parent for p in block_files(tmp_path / "kv")}]
    assert {stat.S_IMODE(f.stat().st_mode) for f in folders} == {0o700}
    assert {stat.S_IMODE(p.stat().st_mode) for p in block_files(tmp_path / "kv")} == {0o600}


@pytest.fixture(scope="module")
def tier(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DiskTier, Path, bytes]]:
    """A tier holding one valid block file: (tier, that file's path, its bytes)."""
    tier = DiskTier(str(tmp_path_factory.mktemp("tier")), 2**20, b"fp", SEAL_KEY)
    tier.store(record((1, 2, 3, 4)), kv(0))
    tier.flush()
    path = Path(tier._path(record((1, 2, 3, 4)).key))
    yield tier, path, path.read_bytes()
    tier.close()


def _xor(data: bytes, flips: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for offset, mask in flips:
        out[offset] ^= mask
    return bytes(out)


def _edits(valid: bytes) -> st.SearchStrategy[bytes]:
    size = len(valid)
    flips = st.lists(st.tuples(st.integers(0, size - 1), st.integers(1, 255)), min_size=1, max_size=4)
    return st.one_of(
        st.binary(max_size=2 * size),
        st.integers(0, size - 1).map(lambda n: valid[:n]),
        st.binary(min_size=1, max_size=64).map(lambda tail: valid + tail),
        flips.map(lambda fs: _xor(valid, fs)),
        st.integers(0, 200_000).map(lambda n: MAGIC + n.to_bytes(4, "little") + b"[" * n),
    )


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_any_bytes_in_a_block_file_are_a_miss_with_a_warning_or_the_block_itself(
    tier: tuple[DiskTier, Path, bytes], data: st.DataObject, caplog: pytest.LogCaptureFixture
) -> None:
    disk, path, valid = tier
    content = data.draw(_edits(valid))
    block = record((1, 2, 3, 4))
    with disk._lock:
        disk._index[block.key] = len(content)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_bytes(content)
    path.chmod(0o600)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvserve.cache"):
        loaded = disk.load(block, SHAPE, torch.float32)
    if content == valid:
        assert loaded is not None and torch.equal(loaded, kv(0))
    else:
        assert loaded is None and any("dropped block" in m for m in _warnings(caplog))
