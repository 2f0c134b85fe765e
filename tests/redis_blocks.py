"""The Redis tier's test blocks: records chained like the engine's, their KV, and what an admission
loads; shared by the tier's tests in tests/cache and tests/cluster."""

import torch

from kvserve.cache.block_key import ROOT, chain_key
from kvserve.cache.redis_tier import RedisTier
from kvserve.cache.tiers import BlockRecord

SECRET = bytes(range(32))
FINGERPRINT = b"model-a"
SHAPE = (2, 2, 3, 4, 5)
DTYPE = torch.float32


def records(
    namespace: str, tokens: list[int], block_size: int = 4, fingerprint: bytes = FINGERPRINT
) -> list[BlockRecord]:
    out: list[BlockRecord] = []
    parent = ROOT
    for j in range(len(tokens) // block_size):
        block = tuple(tokens[j * block_size : (j + 1) * block_size])
        key = chain_key(fingerprint, namespace, parent, block)
        out.append(BlockRecord(key, parent, namespace, block))
        parent = key
    return out


def kv_of(record: BlockRecord) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(record.key[:4], "little"))
    return torch.randn(SHAPE, generator=g, dtype=DTYPE)


def load_run(tier: RedisTier, run: list[BlockRecord]) -> list[torch.Tensor]:
    """What an admission gets: the blocks of `run` in order, up to the first the tier does not hold."""
    tier.prefetch(run, SHAPE, DTYPE)
    out: list[torch.Tensor] = []
    try:
        for r in run:
            if not tier.contains(r.key):
                break
            kv = tier.load(r, SHAPE, DTYPE)
            if kv is None:
                break
            out.append(kv)
    finally:
        tier.prefetch([], SHAPE, DTYPE)
    return out


def store_all(tier: RedisTier, run: list[BlockRecord]) -> None:
    for r in run:
        tier.store(r, kv_of(r))
    tier.flush()
