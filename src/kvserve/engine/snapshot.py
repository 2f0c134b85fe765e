"""A point-in-time view of the engine for people watching it: pool, counters, hot prefixes, requests.

Taken on the engine thread (through `AsyncEngine.call`) and cheap by construction: the hot prefixes come
from the prefix cache's bounded hit set, requests are capped, and pool usage is the manager's summary.
The server's dashboard and `kvserve chat`'s `/stats` both render it.
"""

import time
from dataclasses import dataclass

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
    cache = engine.kv.prefix_cache
    branches = cache.hot_branches(max_branches, namespace) if cache is not None else []
    mine = [r for r in engine.requests.values() if namespace is None or r.namespace == namespace]
    mine.sort(key=lambda r: (r.status is not RequestStatus.RUNNING, r.arrival_time))
    return Snapshot(
        time=now,
        stats=engine.stats(),
        block_size=engine.config.block_size,
        branches=branches,
        requests=[_info(r, now) for r in mine[:max_requests]],
        num_requests=len(mine),
    )
