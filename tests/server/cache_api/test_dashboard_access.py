"""Who sees what on the dashboard's JSON once tenants exist: the admin key sees every namespace and the
server-wide counters; a tenant's key only its own namespace's prefixes, requests and hit counters."""

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.model.loader import LoadedModel
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from kvserve.server.http.tenants import Tenants

SYSTEM = list(range(200, 264))


@pytest.mark.usefixtures("one_thread")
def test_the_admin_sees_everything_and_a_tenant_only_its_own_namespace(
    tiny_model: LoadedModel, serve_app: Callable[[FastAPI], AbstractContextManager[str]], tmp_path: Any
) -> None:
    key_file = tmp_path / "keys.txt"
    key_file.write_text("alice:alice-key-1\nbob:bob-key-22\n")
    tenants = Tenants(os.urandom(32), key_file=str(key_file))
    engine = Engine.from_config(
        EngineConfig(kv_cache_memory=4 * 2**20, max_model_len=256, weight_dtype="float32"), model=tiny_model
    )
    app = create_app(AsyncEngine(engine), ServerOptions(admin_key="admin-key-333"), tenants)
    with serve_app(app) as url:

        def call(key: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"}
            if body is None:
                return httpx.get(f"{url}{path}", headers=headers, timeout=30)
            return httpx.post(f"{url}{path}", headers=headers, json=body, timeout=60)

        for suffix in ([300], [301], [302]):
            assert call(
                "alice-key-1", "/v1/completions", {"prompt": SYSTEM + suffix, "max_tokens": 2}
            ).is_success
        admin = call("admin-key-333", "/v1/cache/stats").json()
        alice = call("alice-key-1", "/v1/cache/stats").json()
        bob = call("bob-key-22", "/v1/cache/stats").json()
        assert call("wrong-key-4444", "/v1/cache/stats").status_code == 401

        assert admin["scope"] == "all" and admin["counters"]["prompt_tokens"] == 3 * 65
        assert [(b["tokens"], b["hits"]) for b in admin["branches"]] == [(64, 2)]
        assert alice["scope"] == "tenant" and alice["branches"] == admin["branches"]
        assert alice["counters"]["cache_queries"] == 3 * 65 and alice["counters"]["cache_hits"] == 2 * 64
        assert alice["counters"]["prompt_tokens"] is None and alice["history"] == []
        assert bob["scope"] == "tenant" and bob["branches"] == [] and bob["counters"]["cache_hits"] == 0
        # Acceptance comes from every tenant's traffic: the admin sees it, a tenant does not.
        assert admin["speculation"]["method"] in ("suffix", "off")
        assert alice["speculation"] is None and bob["speculation"] is None
