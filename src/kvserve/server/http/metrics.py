"""Prometheus metrics: latencies measured by the server per request, engine counters read at scrape time.

Each app has its own CollectorRegistry, so that several apps (tests, replicas in one process) never share
or clash. Besides kvserve's own names, the vLLM names that dashboards and benchmark tools read are
exposed with vLLM's types and units: `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total`
(counters, in tokens), `vllm:kv_cache_usage_perc` (a gauge from 0 to 1), and speculation's
`vllm:spec_decode_num_drafts_total` (a sequence's verified drafts: one per sequence per step that
verified one), `vllm:spec_decode_num_draft_tokens_total` and `vllm:spec_decode_num_accepted_tokens_total`
(tokens). Their ratios are the acceptance rate (accepted / draft tokens) and the mean accepted length per
draft (accepted / drafts; vLLM's logs print 1 + that, counting the token every verification yields).
"""

import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvserve.cache.cache_miss import MISS_REASONS
from kvserve.cache.retention import DROPPED_BUDGET, DROPPED_MEMORY, DROPPED_SERVER_CAP
from kvserve.cache.tiers import TIER_MEMORY, LatencySnapshot, TierUsage
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import EngineStats

_LABELS = ["model_name"]
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160, 320, 640)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 240, 480, 960, 1920, 3600)


class EngineStatsCollector:
    """Turns the last EngineStats snapshot into metric families; the scrape route refreshes it first."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def collect(self) -> Iterable[Metric]:
        s = self.stats
        if s is None:
            return
        c = s.cache
        families: list[tuple[type[GaugeMetricFamily] | type[CounterMetricFamily], str, str, float]] = [
            (
                GaugeMetricFamily,
                "kvserve_num_requests_running",
                "Requests in the running batch.",
                s.num_running,
            ),
            (GaugeMetricFamily, "kvserve_num_requests_waiting", "Requests waiting to start.", s.num_waiting),
            (CounterMetricFamily, "kvserve_prompt_tokens", "Prompt tokens received.", s.prompt_tokens),
            (CounterMetricFamily, "kvserve_generation_tokens", "Tokens generated.", s.generation_tokens),
            (
                CounterMetricFamily,
                "kvserve_prefill_tokens_computed",
                "Prompt tokens the model computed (the rest came from the prefix cache).",
                s.prefill_tokens_computed,
            ),
            (
                CounterMetricFamily,
                "kvserve_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                s.cache_queries,
            ),
            (
                CounterMetricFamily,
                "kvserve_prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                s.cache_hits,
            ),
            (
                GaugeMetricFamily,
                "kvserve_prefix_cache_hit_rate",
                "Prefix cache hits over queries since start, in tokens.",
                s.hit_rate,
            ),
            (
                GaugeMetricFamily,
                "kvserve_kv_cache_usage_ratio",
                "Fraction of KV blocks held by requests (0 to 1).",
                c.usage,
            ),
            (GaugeMetricFamily, "kvserve_kv_cache_blocks", "KV blocks in the pool.", c.num_blocks),
            (GaugeMetricFamily, "kvserve_kv_cache_free_blocks", "KV blocks on the free list.", c.num_free),
            (
                GaugeMetricFamily,
                "kvserve_kv_cache_cached_blocks",
                "KV blocks in the prefix cache.",
                c.num_cached,
            ),
            (
                GaugeMetricFamily,
                "kvserve_kv_cache_locked_blocks",
                "KV blocks held by requests.",
                c.num_locked,
            ),
            (
                CounterMetricFamily,
                "kvserve_kv_cache_evicted_blocks",
                "Cached KV blocks evicted to make room.",
                c.num_evicted,
            ),
            (
                CounterMetricFamily,
                "kvserve_state_recomputed_tokens",
                "Hybrid models: prompt tokens the prefix cache held but that were recomputed for want of "
                "a recurrent-state checkpoint nearer the match's end.",
                s.recomputed_tokens,
            ),
            (
                CounterMetricFamily,
                "kvserve_preemptions",
                "Requests preempted for lack of KV memory.",
                s.preemptions,
            ),
            (GaugeMetricFamily, "vllm:num_requests_running", "Requests in the running batch.", s.num_running),
            (GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to start.", s.num_waiting),
            (
                CounterMetricFamily,
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                s.cache_queries,
            ),
            (
                CounterMetricFamily,
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                s.cache_hits,
            ),
            (
                GaugeMetricFamily,
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                c.usage,
            ),
            (
                CounterMetricFamily,
                "vllm:spec_decode_num_drafts",
                "Number of spec decoding drafts.",
                s.spec_drafts,
            ),
            (
                CounterMetricFamily,
                "vllm:spec_decode_num_draft_tokens",
                "Number of draft tokens.",
                s.spec_draft_tokens,
            ),
            (
                CounterMetricFamily,
                "vllm:spec_decode_num_accepted_tokens",
                "Number of accepted tokens.",
                s.spec_accepted_tokens,
            ),
        ]
        families.append(
            (GaugeMetricFamily, "kvserve_kv_cache_pinned_blocks", "KV blocks held by pins.", c.num_pinned)
        )
        families.append(
            (
                GaugeMetricFamily,
                "kvserve_kv_cache_retained_blocks",
                "KV blocks held by prompt-cache retentions (cache_control breakpoints).",
                c.num_retained,
            )
        )
        if c.max_state_checkpoints:
            families.append(
                (
                    GaugeMetricFamily,
                    "kvserve_state_checkpoints",
                    "Hybrid models: recurrent-state checkpoints the prefix cache holds.",
                    c.num_state_checkpoints,
                )
            )
        if s.step_costs is not None:
            costs = s.step_costs
            families += [
                (
                    GaugeMetricFamily,
                    "kvserve_spec_step_fixed_seconds",
                    "A step's fixed time as measured here (the drafter's cost model).",
                    costs.fixed,
                ),
                (
                    GaugeMetricFamily,
                    "kvserve_spec_decode_row_seconds",
                    "What a decode row adds to a step, as measured here.",
                    costs.decode,
                ),
                (
                    GaugeMetricFamily,
                    "kvserve_spec_draft_row_seconds",
                    "What a draft row adds to a step, as measured here.",
                    costs.draft,
                ),
                (
                    GaugeMetricFamily,
                    "kvserve_spec_row_cost",
                    "A draft row's cost over a step's fixed part, as measured here.",
                    costs.draft / costs.fixed,
                ),
            ]
        for family_type, name, doc, value in families:
            family = family_type(name, doc, labels=_LABELS)
            family.add_metric([self.model_name], value)
            yield family
        yield from self._retentions_dropped(s)
        yield from self._misses(s)
        yield from self._tiers(s)

    def _retentions_dropped(self, s: EngineStats) -> Iterable[Metric]:
        """Retentions dropped whole before their TTL, and retained blocks given up (trimmed from a
        retention's end, or with it), by reason: a tenant over its budget, the server's cap, or memory
        no request could run without (cache/retention.py)."""
        dropped = CounterMetricFamily(
            "kvserve_retentions_dropped",
            "Prompt-cache retentions dropped whole before their TTL, by reason (budget, server_cap, memory).",
            labels=[*_LABELS, "reason"],
        )
        blocks = CounterMetricFamily(
            "kvserve_retained_blocks_dropped",
            "Retained KV blocks given up before their TTL, by reason (budget, server_cap, memory).",
            labels=[*_LABELS, "reason"],
        )
        for reason in (DROPPED_BUDGET, DROPPED_SERVER_CAP, DROPPED_MEMORY):
            dropped.add_metric([self.model_name, reason], s.cache.retentions_dropped.get(reason, 0))
            blocks.add_metric([self.model_name, reason], s.cache.retained_blocks_dropped.get(reason, 0))
        yield dropped
        yield blocks

    def _misses(self, s: EngineStats) -> Iterable[Metric]:
        """Admissions that computed text their namespace had seen, by reason (cache/cache_miss.py)."""
        misses = CounterMetricFamily(
            "kvserve_cache_misses",
            "Prompts that computed again text their namespace had seen lately, by reason.",
            labels=[*_LABELS, "reason"],
        )
        for reason in MISS_REASONS:
            misses.add_metric([self.model_name, reason], s.misses_by_reason.get(reason, 0))
        yield misses

    def _tiers(self, s: EngineStats) -> Iterable[Metric]:
        """Hits per tier (memory, disk) and each lower tier's usage and latencies, labelled by tier."""
        labels = [*_LABELS, "tier"]
        hits = CounterMetricFamily(
            "kvserve_prefix_cache_hits_by_tier",
            "Prompt tokens found in the cache, by the tier that held them.",
            labels=labels,
        )
        for tier in (TIER_MEMORY, *(t.name for t in s.cache.tiers)):
            hits.add_metric([self.model_name, tier], s.hits_by_tier.get(tier, 0))
        yield hits
        gauges: list[tuple[str, str, Callable[[TierUsage], float]]] = [
            ("kvserve_kv_tier_bytes_used", "Bytes a lower cache tier holds.", lambda t: t.bytes_used),
            (
                "kvserve_kv_tier_capacity_bytes",
                "Byte budget of a lower cache tier.",
                lambda t: t.capacity_bytes,
            ),
            ("kvserve_kv_tier_blocks", "KV blocks a lower cache tier holds.", lambda t: t.num_blocks),
        ]
        counters: list[tuple[str, str, Callable[[TierUsage], float]]] = [
            ("kvserve_kv_tier_stores", "Blocks written to a lower cache tier.", lambda t: t.stores),
            (
                "kvserve_kv_tier_stores_dropped",
                "Blocks not written to a lower cache tier (queue full or write error).",
                lambda t: t.stores_dropped,
            ),
            ("kvserve_kv_tier_loads", "Blocks loaded from a lower cache tier.", lambda t: t.loads),
            (
                "kvserve_kv_tier_loads_failed",
                "Blocks and state checkpoints refused on load (missing, truncated, corrupt, foreign, "
                "sealed under another secret, or a state whose tensors disagree with the model's); "
                "recomputed.",
                lambda t: t.loads_failed,
            ),
            (
                "kvserve_kv_tier_misses",
                "Blocks looked for in a remote tier and not found there (or not asked: the tier was down).",
                lambda t: t.misses,
            ),
            (
                "kvserve_kv_tier_errors",
                "Calls to a remote tier that failed (down, slow or reset): misses, never failed requests.",
                lambda t: t.errors,
            ),
        ]
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            for t in s.cache.tiers:
                gauge.add_metric([self.model_name, t.name], value(t))
            yield gauge
        for name, doc, value in counters:
            counter = CounterMetricFamily(name, doc, labels=labels)
            for t in s.cache.tiers:
                counter.add_metric([self.model_name, t.name], value(t))
            yield counter
        histograms: list[tuple[str, str, Callable[[TierUsage], LatencySnapshot]]] = [
            ("kvserve_kv_tier_load_seconds", "Time to load and verify one block.", lambda t: t.load_latency),
            (
                "kvserve_kv_tier_store_seconds",
                "Time to write one block (off the step).",
                lambda t: t.store_latency,
            ),
        ]
        for name, doc, snapshot in histograms:
            histogram = HistogramMetricFamily(name, doc, labels=labels)
            for t in s.cache.tiers:
                h = snapshot(t)
                buckets = [(str(b), float(c)) for b, c in zip(h.buckets, h.cumulative, strict=False)]
                buckets.append(("+Inf", float(h.count)))
                histogram.add_metric([self.model_name, t.name], buckets, h.total)
            yield histogram


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._engine = EngineStatsCollector(model_name)
        self.registry.register(self._engine)
        self.time_to_first_token = Histogram(
            "kvserve_time_to_first_token_seconds",
            "From request arrival to its first token, measured by the server.",
            _LABELS,
            registry=self.registry,
            buckets=_TTFT_BUCKETS,
        ).labels(model_name)
        self.inter_token_latency = Histogram(
            "kvserve_inter_token_latency_seconds",
            "Between consecutive tokens of a request, measured by the server.",
            _LABELS,
            registry=self.registry,
            buckets=_ITL_BUCKETS,
        ).labels(model_name)
        self.e2e_latency = Histogram(
            "kvserve_e2e_request_latency_seconds",
            "From request arrival to its last token.",
            _LABELS,
            registry=self.registry,
            buckets=_E2E_BUCKETS,
        ).labels(model_name)
        self._finished = Counter(
            "kvserve_requests_finished",
            "Requests that ended, by reason (abort: the client left first).",
            [*_LABELS, "finish_reason"],
            registry=self.registry,
        )

        # Per tenant, from each request's usage: one tenant's hit rate, without the others' traffic.
        self._tenant_queries = Counter(
            "kvserve_tenant_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache, per tenant.",
            [*_LABELS, "tenant"],
            registry=self.registry,
        )
        self._tenant_hits = Counter(
            "kvserve_tenant_prefix_cache_hits",
            "Prompt tokens found in the tenant's own namespace of the prefix cache, per tenant.",
            [*_LABELS, "tenant"],
            registry=self.registry,
        )

    def tenant_prefix_cache(self, tenant: str, prompt_tokens: int, cached_tokens: int) -> None:
        self._tenant_queries.labels(self.model_name, tenant).inc(prompt_tokens)
        self._tenant_hits.labels(self.model_name, tenant).inc(cached_tokens)

    def tenant_prefix_cache_totals(self, tenant: str) -> tuple[int, int]:
        """One tenant's (prompt tokens looked up, tokens hit) so far, read back from its counters."""
        labels = {"model_name": self.model_name, "tenant": tenant}
        queries = self.registry.get_sample_value("kvserve_tenant_prefix_cache_queries_total", labels)
        hits = self.registry.get_sample_value("kvserve_tenant_prefix_cache_hits_total", labels)
        return int(queries or 0), int(hits or 0)

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    async def exposition(self, async_engine: AsyncEngine) -> bytes:
        self._engine.stats = await async_engine.stats()
        return generate_latest(self.registry)


class RequestTimer:
    """One request's latencies, observed as its tokens arrive."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.started = time.monotonic()
        self.first_token_at: float | None = None
        self._last_token_at = self.started

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        gap = now - self._last_token_at
        if self.first_token_at is None:
            self.first_token_at = now
            self.metrics.time_to_first_token.observe(gap)
            n -= 1
        # Tokens that arrive together share the gap since the previous arrival.
        for _ in range(n):
            self.metrics.inter_token_latency.observe(gap / n)
        self._last_token_at = now

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started
