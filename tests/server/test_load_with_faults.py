"""Load with faults: 64 concurrent streams over 4 tenants, a third of the clients hanging up at random
points. Every other request completes with the greedy text it has alone, and afterwards every KV block
is free or cached (read from /metrics): nothing leaked."""

import asyncio
import json
import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from kvserve.server.http.tenants import Tenants, load_or_create_secret

CLIENTS = 64
TENANTS = 4
MAX_TOKENS = 8
PROMPTS = [
    "The capital of France is",
    "List three colors:",
    "Once upon a time, in a small village,",
    "The best way to learn a language is",
    "Water boils at",
    "My favourite animal is the",
    "def fibonacci(n):",
    "The sun rises in the",
]


ADMIN_KEY = "admin-key-load"


def _key(tenant: int) -> str:
    return f"key-tenant-{tenant}"


def _gauges(url: str) -> dict[str, float]:
    r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60)
    assert r.status_code == 200
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(r.text)
        for sample in family.samples
        if sample.name.startswith(("kvserve_kv_cache", "kvserve_num_requests"))
        or sample.labels.get("finish_reason") == "abort"
    }


async def _client(
    url: str, tenant: int, prompt: str, hang_up_after: int | None, rng: random.Random
) -> str | None:
    """One streamed completion; returns its text, or None after hanging up at the chosen point (before
    the response when hang_up_after is 0, else after that many events)."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {_key(tenant)}"}
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        if hang_up_after == 0:
            request = asyncio.ensure_future(client.post("/v1/completions", json=body, headers=headers))
            await asyncio.sleep(rng.uniform(0, 0.5))
            request.cancel()
            await asyncio.gather(request, return_exceptions=True)
            return None
        text = ""
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200, await r.aread()
            events = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events += 1
                if hang_up_after is not None and events >= hang_up_after:
                    return None
                choices = json.loads(line.removeprefix("data: "))["choices"]
                text += choices[0]["text"] if choices else ""
        return text


@pytest.mark.timeout(600)
def test_64_streams_over_4_tenants_with_random_hang_ups(
    tmp_path: Path,
    make_engine: Callable[..., Engine],
    serve_app: Callable[[FastAPI], AbstractContextManager[str]],
) -> None:
    (tmp_path / "keys").write_text("".join(f"t{t}:{_key(t)}\n" for t in range(TENANTS)))
    tenants = Tenants(load_or_create_secret(str(tmp_path)), key_file=str(tmp_path / "keys"))
    async_engine = AsyncEngine(make_engine(kv_cache_memory=128 * 2**20, max_model_len=512))
    rng = random.Random(6)
    with serve_app(create_app(async_engine, ServerOptions(admin_key=ADMIN_KEY), tenants)) as url:
        # The greedy text of each prompt, run alone.
        alone = {p: asyncio.run(_client(url, 0, p, None, rng)) for p in PROMPTS}

        plan = [
            (i % TENANTS, PROMPTS[i % len(PROMPTS)], rng.randrange(4) if i % 3 == 0 else None)
            for i in range(CLIENTS)
        ]
        rng.shuffle(plan)

        async def storm() -> list[str | None]:
            return await asyncio.gather(*(_client(url, t, p, h, rng) for t, p, h in plan))

        results = asyncio.run(storm())
        completed = [(p, text) for (_, p, h), text in zip(plan, results, strict=True) if h is None]
        assert len(completed) == CLIENTS - len([h for _, _, h in plan if h is not None]) >= 40
        for prompt, text in completed:
            assert text == alone[prompt], prompt

        deadline = time.monotonic() + 120
        while True:
            gauges = _gauges(url)
            busy = gauges["kvserve_num_requests_running"] + gauges["kvserve_num_requests_waiting"]
            if busy == 0 and gauges["kvserve_kv_cache_locked_blocks"] == 0:
                break
            assert time.monotonic() < deadline, gauges
            time.sleep(0.1)
        free, cached = gauges["kvserve_kv_cache_free_blocks"], gauges["kvserve_kv_cache_cached_blocks"]
        assert free + cached == gauges["kvserve_kv_cache_blocks"], gauges
        assert async_engine.num_in_flight == 0
        # Hang-ups did abort requests in the engine (a few may have finished before being noticed).
        assert gauges["kvserve_requests_finished_total"] > 0
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
