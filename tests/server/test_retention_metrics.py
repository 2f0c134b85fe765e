"""Retention from the server's side: the helper a route calls with a request's breakpoints, and what
/metrics and GET /v1/cache then show (retained blocks, the cap, retentions dropped by reason)."""

import asyncio
from collections.abc import Callable
from contextlib import AbstractContextManager

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.request import DEFAULT_TENANT
from kvserve.model.loader import LoadedModel
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from kvserve.server.context import ServerContext
from kvserve.server.retention import CACHE_CONTROL_TTLS, DEFAULT_CACHE_CONTROL_TTL, retain_breakpoints
from kvserve.server.tenants import Tenant
from tests.harness import engine_with_blocks

pytestmark = pytest.mark.usefixtures("one_thread")

PREFIX = [100 + (i * 13) % 3000 for i in range(40)]


def test_the_server_helper_and_what_metrics_and_the_cache_view_show(
    tiny_model: LoadedModel, serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> None:
    engine = engine_with_blocks(tiny_model, 64, 4, retention_budget=0.5)
    app = create_app(AsyncEngine(engine), ServerOptions())
    ctx: ServerContext = app.state.context
    namespace = ctx.tenants.namespace(Tenant(DEFAULT_TENANT))
    assert CACHE_CONTROL_TTLS[DEFAULT_CACHE_CONTROL_TTL] == 300.0 and CACHE_CONTROL_TTLS["1h"] == 3600.0
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        r = client.post("/v1/completions", json={"prompt": PREFIX, "max_tokens": 1})
        assert r.status_code == 200, r.text
        held = asyncio.run(
            retain_breakpoints(ctx, namespace, PREFIX, [(16, 3600.0), (40, 300.0), (99, 300.0)])
        )
        assert held == [16, 40, 0]
        assert asyncio.run(retain_breakpoints(ctx, namespace, PREFIX, [])) == []
        memory = client.get("/v1/cache").json()["tiers"][0]
        assert (memory["retained_blocks"], memory["max_retained_blocks"]) == (10, 32)
        samples = {
            (s.name, s.labels.get("reason")): s.value
            for f in text_string_to_metric_families(client.get("/metrics").text)
            for s in f.samples
        }
        assert samples[("kvserve_kv_cache_retained_blocks", None)] == 10
        assert samples[("kvserve_retentions_dropped_total", "budget")] == 0
        assert samples[("kvserve_retentions_dropped_total", "memory")] == 0
