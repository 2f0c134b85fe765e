"""The disk tier: blocks evicted from memory or lost in a restart come back from disk, verified; a
damaged, missing or foreign file is dropped and recomputed, never served. Outputs are compared token for
token with a no-cache engine (float64 tiny model, see tests/harness.py)."""

import dataclasses
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from kvserve.cache.disk_tier import DiskTier
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
from tests.harness import (
    assert_cached_kv_is_fresh,
    drive,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_outputs_are_identical_when_most_hits_come_from_disk(
    tiny_model: LoadedModel, reference: Engine, engines: list[Engine], tmp_path: Path
) -> None:
    engine = disk_engine(tiny_model, tmp_path, engines)
    run_and_check(engine, reference, rounds(3))
    hits = engine.stats().hits_by_tier
    # Memory's share is whatever survives while a request waits for its load (other admissions evict
    # in a 24-block pool); the disk's is most of it.
    assert hits.get("disk", 0) > hits.get("memory", 0)
    assert_cached_kv_is_fresh(engine, tiny_model, sample=12)
    usage = engine.kv.usage().tiers[0]
    assert usage.loads > 0 and usage.loads_failed == 0 and usage.bytes_used > 0


def test_a_restart_finds_the_cache_on_disk(
    tiny_model: LoadedModel, reference: Engine, engines: list[Engine], tmp_path: Path
) -> None:
    first = disk_engine(tiny_model, tmp_path, engines, num_blocks=128)
    run_and_check(first, reference, rounds(1))
    first.close()
    second = disk_engine(tiny_model, tmp_path, engines, num_blocks=128)
    run_and_check(second, reference, rounds(1))
    stats = second.stats()
    # Every full block of every prompt but the last token's comes from disk.
    assert stats.hits_by_tier["disk"] == len(DOCUMENTS) * 40
    assert stats.cache_hits == stats.hits_by_tier["disk"]


@pytest.mark.parametrize("change", ["weights", "kv dtype"])
def test_another_model_or_setting_never_reads_the_files(
    tiny_model: LoadedModel, reference: Engine, engines: list[Engine], tmp_path: Path, change: str
) -> None:
    first = disk_engine(tiny_model, tmp_path, engines)
    run_and_check(first, reference, rounds(1))
    first.close()
    if change == "weights":
        name = next(iter(tiny_model.weights))
        weights = {**tiny_model.weights, name: tiny_model.weights[name] + 1e-3}
        other = disk_engine(dataclasses.replace(tiny_model, weights=weights), tmp_path, engines)
    else:
        config = dataclasses.replace(first.config, dtype="float32")
        other = Engine.from_config(config, model=tiny_model)
        engines.append(other)
    drive(other, DOCUMENTS, rounds(1))
    assert "disk" not in other.stats().hits_by_tier


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x5A
    path.write_bytes(bytes(data))


def damage(directory: Path) -> int:
    """Damage most block files in every way the tier must catch; returns how many were damaged."""
    files = block_files(directory)
    for i, path in enumerate(files):
        kind = i % 6
        if kind == 0:
            # The sign and exponent byte of a late value (little endian float64): a real change to the KV.
            _flip(path, -1 - 8 * (i % 16))
        elif kind == 1:
            _flip(path, 40)  # header
        elif kind == 2:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        elif kind == 3:
            path.unlink()
        elif kind == 4:
            # A whole, valid file of another block under this block's name.
            shutil.copy(files[(i + 1) % len(files)], path)
    return len(files) - len(files) // 6


def test_damaged_files_are_dropped_with_a_warning_and_recomputed(
    tiny_model: LoadedModel,
    reference: Engine,
    engines: list[Engine],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = disk_engine(tiny_model, tmp_path, engines)
    run_and_check(engine, reference, rounds(1))
    engine.kv.flush()
    # Between requests: memory forgets, the disk is damaged.
    engine.reset_prefix_cache()
    damage(tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvserve.cache"):
        run_and_check(engine, reference, rounds(1))
    assert any("dropped block" in r.message for r in caplog.records)
    assert engine.kv.usage().tiers[0].loads_failed > 0
    assert_cached_kv_is_fresh(engine, tiny_model, sample=1000)
    engine.close()
    # Across a restart, with what the first engine wrote since damaged again.
    damage(tmp_path)
    caplog.clear()
    restarted = disk_engine(tiny_model, tmp_path, engines)
    with caplog.at_level(logging.WARNING, logger="kvserve.cache"):
        run_and_check(restarted, reference, rounds(2))
    assert any("dropped block" in r.message for r in caplog.records)
    assert_cached_kv_is_fresh(restarted, tiny_model, sample=1000)


def test_the_folder_can_be_deleted_while_the_engine_runs(
    tiny_model: LoadedModel, reference: Engine, engines: list[Engine], tmp_path: Path
) -> None:
    directory = tmp_path / "kv"
    engine = disk_engine(tiny_model, directory, engines)
    run_and_check(engine, reference, rounds(1))
    engine.reset_prefix_cache()
    shutil.rmtree(directory)
    run_and_check(engine, reference, rounds(2))
    assert block_files(directory), "the tier writes again once its folder is gone"


def test_disk_space_is_least_recently_used_within_its_size(tmp_path: Path) -> None:
    tier = DiskTier(str(tmp_path), 2**20, b"fp", SEAL_KEY)
    records = [record((i, i, i, i)) for i in range(4)]
    for i in range(3):
        tier.store(records[i], kv(i))
    tier.flush()
    # Room for three and a half files (all the same size).
    tier.capacity_bytes = tier.usage().bytes_used * 7 // 6
    # Loading the oldest makes it the most recently used: the next store evicts the second.
    loaded = tier.load(records[0], (2, 2, BLOCK, 2, 8), torch.float32)
    assert loaded is not None and torch.equal(loaded, kv(0))
    tier.store(records[3], kv(3))
    tier.flush()
    assert [tier.contains(r.key) for r in records] == [True, False, True, True]
    assert tier.usage().bytes_used <= tier.capacity_bytes
    tier.close()


def test_a_killed_writer_leaves_only_whole_files(tmp_path: Path) -> None:
    """A crash mid-write leaves a temporary (removed at startup) or a whole file, never a half file
    under a block's name; a new tier indexes the whole files without reading them."""
    tier = DiskTier(str(tmp_path), 2**20, b"fp", SEAL_KEY)
    records = [record((i, 0, 0, 0)) for i in range(3)]
    for i, r in enumerate(records):
        tier.store(r, kv(i))
    tier.close()
    final = block_files(tmp_path)[0]
    stray = final.with_name(final.name + ".123.tmp")
    stray.write_bytes(final.read_bytes()[:100])
    reopened = DiskTier(str(tmp_path), 2**20, b"fp", SEAL_KEY)
    assert not stray.exists()
    assert reopened.usage().num_blocks == 3 and reopened.usage().loads == 0
    for i, r in enumerate(records):
        loaded = reopened.load(r, (2, 2, BLOCK, 2, 8), torch.float32)
        assert loaded is not None and torch.equal(loaded, kv(i))
    # A record whose parent, namespace or tokens differ is never served another block's file.
    child = record((9, 9, 9, 9), parent=records[0].key)
    target = Path(reopened._path(child.key))
    target.parent.mkdir(exist_ok=True)
    os.replace(reopened._path(records[1].key), target)
    again = DiskTier(str(tmp_path), 2**20, b"fp", SEAL_KEY)
    assert again.contains(child.key)
    assert again.load(child, (2, 2, BLOCK, 2, 8), torch.float32) is None
    assert not again.contains(child.key) and not target.exists()
    reopened.close()
    again.close()
