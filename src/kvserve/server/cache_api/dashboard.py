"""The cache dashboard: `GET /dashboard` (one static page, no build step, no CDN) and the JSON behind it,
`GET /v1/cache/stats`.

The page polls the JSON once a second. The JSON is an engine snapshot (`engine/snapshot.py`: pool by
state, counters, the heaviest hit prefixes from the prefix cache's bounded hit set, requests) plus a
history of the counters, sampled once a second by `StatsHistory` for as long as the server runs, so a page
opened after a benchmark still shows the hit rate over it. Nothing here walks the radix tree.

Prompts are private: a branch's first tokens are shown as text only when the server runs with
`--dashboard-show-text`.
"""

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import resources
from typing import Literal

from pydantic import BaseModel, Field

from kvserve.cache.manager import NamespaceUsage
from kvserve.engine.async_engine import AsyncEngine, EngineDeadError
from kvserve.engine.engine import EngineStats
from kvserve.engine.snapshot import Snapshot
from kvserve.model.tokenizer import Tokenizer
from kvserve.server.cache_api.protocol import TierInfo
from kvserve.server.cache_api.views import lower_tiers, shared_tiers

HISTORY_SECONDS = 600
HEAD_TOKENS = 12


class PoolStats(BaseModel):
    """The KV pool by state, in blocks: free + cached + in_use + pinned = blocks. `cached` blocks hold a
    prefix and nothing else holds them (evictable); `in_use` blocks are held by running requests;
    `pinned` blocks are held only by pins or prompt-cache retentions. `tiers` are the lower tiers, if any.

    A tenant's view counts only its own blocks: `cached` is every block that holds one of its prefixes
    and `pinned` its pins' blocks; the pool-wide fields are null and the lower tiers carry no counts."""

    blocks: int
    block_size: int
    free: int | None
    cached: int
    in_use: int | None
    pinned: int
    evicted: int | None
    usage: float | None
    tiers: list[TierInfo]


class Counters(BaseModel):
    """Since start, in tokens. `saved_prefill_tokens` are prompt tokens served from the cache. For one
    tenant's view only its own cache queries and hits are known: the server-wide fields are null."""

    prompt_tokens: int | None
    generation_tokens: int | None
    cache_queries: int
    cache_hits: int
    prefill_tokens_computed: int
    saved_prefill_tokens: int
    hit_rate: float
    preemptions: int | None


class SpeculationStats(BaseModel):
    """Speculative decoding since start. `method` is the server's `--speculative` ("off": it never
    drafts). `drafts` counts verified drafts (one per sequence per step that verified one), `draft_tokens`
    the tokens they held and `accepted_tokens` those the model accepted. `acceptance_rate` (accepted /
    draft tokens) and `mean_accepted_length` (accepted / drafts, in tokens) are null while nothing was
    drafted. `row_cost` is what a draft row costs over a step's fixed part as measured on this machine
    and model (the drafter's cost model), null where speculation is off."""

    method: str
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float | None
    mean_accepted_length: float | None
    row_cost: float | None = None


class HistoryPoint(BaseModel):
    time: float
    cache_queries: int
    cache_hits: int
    prefill_tokens_computed: int
    usage: float


class BranchStats(BaseModel):
    """A cached prefix that requests hit: `tokens` long, `hits` times, last at `last_hit` (Unix time).
    It extends branch number `parent` of the list (None: no listed one), which is `start` tokens long;
    `text` is where it parts from that one (its first tokens after `start`), only with
    --dashboard-show-text."""

    namespace: str
    tokens: int
    hits: int
    last_hit: float
    text: str | None
    parent: int | None
    start: int


class RequestStats(BaseModel):
    """Built from the engine's `RequestInfo` (`snapshot.py`), field for field."""

    id: str = Field(validation_alias="request_id")
    status: str
    namespace: str
    prompt_tokens: int
    cached_tokens: int | None
    generated_tokens: int
    ttft_s: float | None
    age_s: float


class MissStats(BaseModel):
    """One of the caller's namespace's last misses (server/core/cache_report.py): why, how much, where;
    the text on each side of the position only with --dashboard-show-text."""

    time: float
    reason: str
    missed_tokens: int
    cached_tokens: int
    position: int | None
    part: str | None
    before: str | None
    after: str | None


class CacheStatsResponse(BaseModel):
    """`scope` is "all", or "tenant" when a tenant's key sees only its own namespace (its counters,
    prefixes and requests; no server-wide history, and no `speculation`: the server's acceptance comes from
    every tenant's traffic)."""

    scope: Literal["all", "tenant"]
    time: float
    model: str
    pool: PoolStats
    counters: Counters
    speculation: SpeculationStats | None
    history: list[HistoryPoint]
    branches: list[BranchStats]
    requests: list[RequestStats]
    num_requests: int
    # The caller's own namespace's last misses, the newest first ("why it missed").
    misses: list[MissStats] = Field(default_factory=list)


def short_label(namespace: str) -> str:
    """A short, stable name for a namespace when nothing better is known (namespaces may be long hashes)."""
    return namespace[:12] if namespace else "default"


def pool_stats(stats: EngineStats, block_size: int) -> PoolStats:
    c = stats.cache
    return PoolStats(
        blocks=c.num_blocks,
        block_size=block_size,
        free=c.num_free,
        cached=c.num_evictable,
        in_use=c.num_locked,
        pinned=c.num_blocks - c.num_free - c.num_locked - c.num_evictable,
        evicted=c.num_evicted,
        usage=c.usage,
        tiers=lower_tiers(c),
    )


def tenant_pool(pool: PoolStats, mine: NamespaceUsage) -> PoolStats:
    return pool.model_copy(
        update={
            "free": None,
            "cached": mine.num_cached,
            "in_use": None,
            "pinned": mine.num_pinned,
            "evicted": None,
            "usage": None,
            "tiers": shared_tiers(pool.tiers),
        }
    )


def tenant_counters(queries: int, hits: int) -> Counters:
    return Counters(
        prompt_tokens=None,
        generation_tokens=None,
        cache_queries=queries,
        cache_hits=hits,
        prefill_tokens_computed=queries - hits,
        saved_prefill_tokens=hits,
        hit_rate=hits / queries if queries else 0.0,
        preemptions=None,
    )


def counters(stats: EngineStats) -> Counters:
    return Counters(
        prompt_tokens=stats.prompt_tokens,
        generation_tokens=stats.generation_tokens,
        cache_queries=stats.cache_queries,
        cache_hits=stats.cache_hits,
        prefill_tokens_computed=stats.prefill_tokens_computed,
        saved_prefill_tokens=stats.cache_hits,
        hit_rate=stats.hit_rate,
        preemptions=stats.preemptions,
    )


def speculation_stats(stats: EngineStats, method: str) -> SpeculationStats:
    return SpeculationStats(
        method=method,
        drafts=stats.spec_drafts,
        draft_tokens=stats.spec_draft_tokens,
        accepted_tokens=stats.spec_accepted_tokens,
        acceptance_rate=stats.spec_acceptance_rate,
        mean_accepted_length=stats.spec_mean_accepted_length,
        row_cost=None if stats.step_costs is None else stats.step_costs.draft / stats.step_costs.fixed,
    )


@dataclass
class StatsHistory:
    """The engine's counters once a second for the last HISTORY_SECONDS, sampled by `run`."""

    points: "deque[HistoryPoint]"

    @classmethod
    def empty(cls) -> "StatsHistory":
        return cls(deque(maxlen=HISTORY_SECONDS))

    def add(self, time: float, stats: EngineStats) -> None:
        self.points.append(
            HistoryPoint(
                time=time,
                cache_queries=stats.cache_queries,
                cache_hits=stats.cache_hits,
                prefill_tokens_computed=stats.prefill_tokens_computed,
                usage=stats.cache.usage,
            )
        )

    async def run(self, async_engine: AsyncEngine, interval_s: float = 1.0) -> None:
        """Sample until cancelled or the engine stops."""
        with contextlib.suppress(EngineDeadError):
            while True:
                self.add(time.time(), await async_engine.stats())
                await asyncio.sleep(interval_s)


@dataclass
class Dashboard:
    """The dashboard's server-side state: the history and whether prompts may be shown as text."""

    history: StatsHistory
    show_text: bool

    async def stats(
        self,
        async_engine: AsyncEngine,
        model: str,
        namespace: str | None = None,
        tenant_totals: tuple[int, int] = (0, 0),
        label: Callable[[str], str] = short_label,
    ) -> CacheStatsResponse:
        """The JSON of `GET /v1/cache/stats`: everything (`namespace` None), or one tenant's namespace
        with its own (queries, hits) totals."""
        snapshot = await async_engine.snapshot(namespace)
        tokenizer = async_engine.tokenizer if self.show_text else None
        full = render(snapshot, model, self.history, tokenizer, async_engine.config.speculative, label)
        if namespace is None or snapshot.mine is None:
            return full
        return full.model_copy(
            update={
                "scope": "tenant",
                "pool": tenant_pool(full.pool, snapshot.mine),
                "counters": tenant_counters(*tenant_totals),
                "speculation": None,
                "history": [],
            }
        )


def render(
    snapshot: Snapshot,
    model: str,
    history: StatsHistory,
    tokenizer: Tokenizer | None,
    speculative: str,
    label: Callable[[str], str] = short_label,
) -> CacheStatsResponse:
    """The JSON for one snapshot; `tokenizer` set means branch heads are shown as text, `speculative` is
    the server's `--speculative`, `label` names namespaces."""
    return CacheStatsResponse(
        scope="all",
        time=snapshot.time,
        model=model,
        pool=pool_stats(snapshot.stats, snapshot.block_size),
        counters=counters(snapshot.stats),
        speculation=speculation_stats(snapshot.stats, speculative),
        history=list(history.points),
        branches=[
            BranchStats(
                namespace=label(b.namespace),
                tokens=b.num_tokens,
                hits=b.hits,
                last_hit=b.last_hit,
                text=None if tokenizer is None else tokenizer.decode(list(b.head[:HEAD_TOKENS])),
                parent=b.parent,
                start=b.start,
            )
            for b in snapshot.branches
        ],
        requests=[
            RequestStats.model_validate(replace(r, namespace=label(r.namespace)), from_attributes=True)
            for r in snapshot.requests
        ],
        num_requests=snapshot.num_requests,
    )


ASSETS = {"dashboard.html": "text/html", "dashboard.js": "text/javascript", "dashboard.css": "text/css"}


def asset(name: str) -> str:
    """One of the page's files, shipped in the package (kvserve/server/static)."""
    return resources.files("kvserve.server.static").joinpath(name).read_text()
