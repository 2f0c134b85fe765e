"""The cache as clients see it: the engine's cache views (engine/snapshot.py) as protocol models.

`GET /v1/cache`, the pin routes and the dashboard all show the cache through these.
"""

import time

from kvserve.cache.manager import CacheUsage
from kvserve.cache.tiers import TIER_MEMORY
from kvserve.engine.snapshot import CacheView, PinView
from kvserve.server.cache_api.protocol import CacheStatus, PinInfo, TierInfo


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


def shared_tiers(tiers: list[TierInfo]) -> list[TierInfo]:
    """The lower tiers as a tenant sees them: names and capacities without counts, since every tenant
    shares them and a tier does not count its blocks by namespace."""
    return [t.model_copy(update={"blocks": None, "bytes_used": None}) for t in tiers]


def cache_status(view: CacheView) -> CacheStatus:
    """`GET /v1/cache`: every tier, memory first, and the namespace's pins. A tenant's view (`view.mine`)
    counts the namespace's own blocks in memory (cached, pinned, retained, and its caps) and leaves the
    lower tiers' counts out (`shared_tiers`)."""
    usage, mine = view.usage, view.mine
    cached, pinned, max_pinned, retained, max_retained = (
        (usage.num_cached, usage.num_pinned, usage.max_pinned, usage.num_retained, usage.max_retained)
        if mine is None
        else (mine.num_cached, mine.num_pinned, mine.max_pinned, mine.num_retained, mine.max_retained)
    )
    memory = TierInfo(
        name=TIER_MEMORY,
        blocks=cached,
        bytes_used=cached * view.bytes_per_block,
        capacity_bytes=usage.num_blocks * view.bytes_per_block,
        pinned_blocks=pinned,
        max_pinned_blocks=max_pinned,
        retained_blocks=retained,
        max_retained_blocks=max_retained,
    )
    lower = lower_tiers(usage) if mine is None else shared_tiers(lower_tiers(usage))
    pins = [pin_info(p) for p in view.pins]
    return CacheStatus(block_size=view.block_size, pins=pins, tiers=[memory, *lower])
