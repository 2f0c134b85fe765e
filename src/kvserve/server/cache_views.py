"""The cache as clients see it: the engine's cache views (engine/snapshot.py) as protocol models.

`GET /v1/cache`, the pin routes and the dashboard all show the cache through these.
"""

import time

from kvserve.cache.manager import CacheUsage
from kvserve.cache.tiers import TIER_MEMORY
from kvserve.engine.snapshot import CacheView, PinView
from kvserve.server.protocol import CacheStatus, PinInfo, TierInfo


def pin_info(pin: PinView) -> PinInfo:
    return PinInfo(
        id=pin.pin_id,
        pinned_tokens=pin.num_tokens,
        expires_at=int(time.time() + pin.expires_in_s),
        expires_in_s=round(pin.expires_in_s, 3),
    )


def lower_tiers(usage: CacheUsage) -> list[TierInfo]:
    """The tiers below memory (the disk, Redis)."""
    return [
        TierInfo(name=t.name, blocks=t.num_blocks, bytes_used=t.bytes_used, capacity_bytes=t.capacity_bytes)
        for t in usage.tiers
    ]


def cache_status(view: CacheView) -> CacheStatus:
    """`GET /v1/cache`: every tier, memory first, and the namespace's pins."""
    usage = view.usage
    memory = TierInfo(
        name=TIER_MEMORY,
        blocks=usage.num_cached,
        bytes_used=usage.num_cached * view.bytes_per_block,
        capacity_bytes=usage.num_blocks * view.bytes_per_block,
        pinned_blocks=usage.num_pinned,
        max_pinned_blocks=usage.max_pinned,
    )
    return CacheStatus(
        block_size=view.block_size,
        pins=[pin_info(p) for p in view.pins],
        tiers=[memory, *lower_tiers(usage)],
    )
