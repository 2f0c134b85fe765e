"""Point-in-time views of the engine for people watching it: the snapshot (pool, counters, hot prefixes,
requests) and one namespace's cache view (pool usage, tiers, pins).

Taken on the engine thread (through `AsyncEngine.snapshot` and `AsyncEngine.cache_view`) and cheap by
construction: the hot prefixes come from the prefix cache's bounded hit set, requests are capped, and
pool usage is the manager's summary. The server's dashboard, `GET /v1/cache` and `kvserve chat`'s
`/stats` render them.
"""

import time
from dataclasses import dataclass

from kvserve.cache.manager import CacheUsage, NamespaceUsage, Pin
from kvserve.cache.prefix_cache import Branch
from kvserve.engine.engine import Engine, EngineStats
from kvserve.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class RequestInfo:
    request_id: str
    status: str
    namespace: str
    prompt_tokens: int
    cached_tokens: int | None
    generated_tokens: int
    ttft_s: float | None
    age_s: float


@dataclass(frozen=True)
class Snapshot:
    time: float
    stats: EngineStats
    block_size: int
    branches: list[Branch]
    requests: list[RequestInfo]
    num_requests: int
    # The namespace's own share of the pool when the snapshot is limited to one namespace.
    mine: NamespaceUsage | None = None


def _info(request: Request, now: float) -> RequestInfo:
    first = request.first_token_time
    return RequestInfo(
        request_id=request.request_id,
        status=request.status.value,
        namespace=request.namespace,
        prompt_tokens=request.num_prompt_tokens,
        cached_tokens=request.num_cached_tokens,
        generated_tokens=request.num_output_tokens,
        ttft_s=None if first is None else first - request.arrival_time,
        age_s=now - request.arrival_time,
    )


def take_snapshot(
    engine: Engine, namespace: str | None = None, max_branches: int = 50, max_requests: int = 100
) -> Snapshot:
    """The engine now, limited to one namespace's prefixes and requests when `namespace` is given.

    Requests are listed running first, then waiting, oldest first within each, up to `max_requests`.
    """
    now = time.time()
    branches = engine.kv.prefix_cache.hot_branches(max_branches, namespace)
    mine = [r for r in engine.requests.values() if namespace is None or r.namespace == namespace]
    mine.sort(key=lambda r: (r.status is not RequestStatus.RUNNING, r.arrival_time))
    return Snapshot(
        time=now,
        stats=engine.stats(),
        block_size=engine.config.block_size,
        branches=branches,
        requests=[_info(r, now) for r in mine[:max_requests]],
        num_requests=len(mine),
        mine=None if namespace is None else engine.kv.namespace_usage(namespace),
    )


@dataclass(frozen=True)
class PinView:
    """A pin as its owner sees it: how many tokens it holds and how long it has left."""

    pin_id: str
    num_tokens: int
    expires_in_s: float


@dataclass(frozen=True)
class CacheView:
    """The KV pool and its lower tiers, and one namespace's pins. `mine` is that namespace's own share of
    the pool when the view is a tenant's (None: the whole pool's, for the admin or a server without
    keys); a tenant is shown its own counts only, since the pool's and the shared tiers' counts tell one
    tenant about the others' traffic."""

    usage: CacheUsage
    block_size: int
    bytes_per_block: int
    pins: list[PinView]
    mine: NamespaceUsage | None = None


def pin_view(engine: Engine, pin: Pin) -> PinView:
    return PinView(pin.pin_id, len(pin.tokens), max(0.0, pin.expires_at - engine.kv.clock()))


def take_cache_view(engine: Engine, namespace: str, whole_pool: bool) -> CacheView:
    """`namespace`'s pins, with the whole pool's counts when `whole_pool`, else with the namespace's."""
    return CacheView(
        usage=engine.kv.usage(),
        block_size=engine.config.block_size,
        bytes_per_block=engine.bytes_per_block,
        pins=[pin_view(engine, p) for p in engine.pins(namespace)],
        mine=None if whole_pool else engine.kv.namespace_usage(namespace),
    )
