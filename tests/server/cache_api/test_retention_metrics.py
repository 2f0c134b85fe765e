"""Retention from the server's side: the helper a route calls with a request's breakpoints, and what
/metrics and GET /v1/cache then show (retained blocks, the cap, retentions dropped by reason; a tenant
sees its own blocks and budget)."""

import asyncio
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.request import DEFAULT_TENANT
from kvserve.model.loader import LoadedModel
from kvserve.options import ServerOptions
from kvserve.secret import load_or_create_secret
from kvserve.server.app import create_app
from kvserve.server.core.context import ServerContext
from kvserve.server.core.retention import retain_breakpoints
from kvserve.server.http.tenants import Tenant, Tenants
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


def test_a_tenant_sees_its_own_retained_blocks_and_budget(
    tiny_model: LoadedModel,
    serve_app: Callable[[FastAPI], AbstractContextManager[str]],
    tmp_path: Path,
) -> None:
    keys = {"a": "key-aaaaaaaa", "b": "key-bbbbbbbb"}
    key_file = tmp_path / "keys"
    key_file.write_text("".join(f"{name}:{key}\n" for name, key in keys.items()))
    tenants = Tenants(load_or_create_secret(str(tmp_path)), key_file=str(key_file))
    engine = engine_with_blocks(tiny_model, 64, 4, retention_budget=0.25)
    app = create_app(AsyncEngine(engine), ServerOptions(admin_key="admin-key-0000"), tenants)
    ctx: ServerContext = app.state.context

    def get(key: str, path: str) -> httpx.Response:
        return httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=60)

    with serve_app(app) as url:
        r = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": PREFIX, "max_tokens": 1},
            headers={"Authorization": f"Bearer {keys['a']}"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        namespace = tenants.namespace(Tenant("a"))
        assert asyncio.run(retain_breakpoints(ctx, namespace, PREFIX, [(40, 300.0)])) == [40]
        memory = {who: get(key, "/v1/cache").json()["tiers"][0] for who, key in keys.items()}
        assert (memory["a"]["retained_blocks"], memory["a"]["max_retained_blocks"]) == (10, 16)
        assert (memory["b"]["retained_blocks"], memory["b"]["max_retained_blocks"]) == (0, 16)
        admin = get("admin-key-0000", "/v1/cache").json()["tiers"][0]
        assert (admin["retained_blocks"], admin["max_retained_blocks"]) == (10, 32)
