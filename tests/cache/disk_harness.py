"""The disk tier's test engines, documents and blocks, shared by the tier's tests."""

from pathlib import Path

import torch

from kvserve.cache.block_key import ROOT, chain_key
from kvserve.cache.tiers import BlockRecord
from kvserve.engine.engine import Engine
from kvserve.model.loader import LoadedModel
from tests.harness import (
    Run,
    Spec,
    assert_matches_reference,
    assert_no_leak,
    drive,
    engine_with_blocks,
    reference_outputs,
)

BLOCK = 4
SEAL_KEY = bytes(range(32))
# Eight 40-token documents (80 blocks in all) against a 24-block pool: most hits must come from disk.
DOCUMENTS = [[100 + (d * 37 + i * 11) % 3900 for i in range(40)] for d in range(8)]


def rounds(n: int) -> list[Spec]:
    return [
        Spec(base=("system", d), suffix=[200 + r, 300 + d], max_tokens=4, arrival=r * 40 + d)
        for r in range(n)
        for d in range(len(DOCUMENTS))
    ]


def disk_engine(model: LoadedModel, directory: Path, made: list[Engine], **overrides: object) -> Engine:
    overrides.setdefault("kv_disk", str(directory))
    engine = engine_with_blocks(model, overrides.pop("num_blocks", 24), BLOCK, **overrides)  # type: ignore[arg-type]
    made.append(engine)
    return engine


def run_and_check(engine: Engine, reference: Engine, specs: list[Spec]) -> Run:
    run = drive(engine, DOCUMENTS, specs)
    assert_matches_reference(run, reference_outputs(reference, run))
    assert_no_leak(engine)
    return run


def block_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*/*.kv"))


def record(tokens: tuple[int, ...], parent: bytes = ROOT, namespace: str = "") -> BlockRecord:
    return BlockRecord(chain_key(b"fp", namespace, parent, tokens), parent, namespace, tokens)


def kv(seed: int) -> torch.Tensor:
    return torch.randn((2, 2, BLOCK, 2, 8), generator=torch.Generator().manual_seed(seed))
