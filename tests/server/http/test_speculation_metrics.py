"""Speculation's counters as the server shows them: vLLM's `vllm:spec_decode_*` counters on /metrics and
the dashboard's acceptance rate, read from EngineStats, over HTTP with speculation on and off."""

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine, EngineStats
from kvserve.engine.step_cost import StepCosts
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from kvserve.server.cache_api.dashboard import speculation_stats
from kvserve.server.http.metrics import EngineStatsCollector
from kvserve_bench.workloads import REPEAT_AGAIN, REPEAT_ASK
from tests.server.live import Server

SPEC_FAMILIES = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


@pytest.fixture(scope="module")
def servers(
    make_engine: Callable[..., Engine], serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[dict[str, Server]]:
    with ExitStack() as stack:
        running = {}
        for method in ("suffix", "off"):
            async_engine = AsyncEngine(make_engine(speculative=method))
            url = stack.enter_context(serve_app(create_app(async_engine, ServerOptions())))
            running[method] = Server(url, async_engine)
        yield running


def spec_samples(text: str) -> dict[str, tuple[str, dict[str, str], float]]:
    """Each speculation family's (type, labels, value) in a /metrics text."""
    found = {}
    for family in text_string_to_metric_families(text):
        if family.name in SPEC_FAMILIES:
            (sample,) = [s for s in family.samples if s.name.endswith("_total")]
            found[family.name] = (family.type, sample.labels, sample.value)
    return found


def repeat_conversation(url: str) -> None:
    """A list, then the same answer again: the text speculation drafts from."""
    messages = [{"role": "user", "content": REPEAT_ASK.format(topic="fruits")}]
    for _ in range(2):
        body = {"messages": messages, "max_tokens": 40, "temperature": 0}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        messages += [
            {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": REPEAT_AGAIN},
        ]


def test_the_counters_are_vllms_follow_the_engine_and_move_only_with_speculation_on(
    servers: dict[str, Server],
) -> None:
    for method, server in servers.items():
        repeat_conversation(server.url)
        stats: EngineStats = server.wait_idle()
        found = spec_samples(httpx.get(f"{server.url}/metrics", timeout=30).text)
        assert set(found) == set(SPEC_FAMILIES)
        assert all(
            t == "counter" and labels == {"model_name": "SmolLM2-135M-Instruct"}
            for t, labels, _ in found.values()
        )
        drafts, drafted, accepted = (found[name][2] for name in SPEC_FAMILIES)
        assert (drafts, drafted, accepted) == (
            stats.spec_drafts,
            stats.spec_draft_tokens,
            stats.spec_accepted_tokens,
        )
        assert accepted <= drafted and drafts <= drafted
        if method == "off":
            assert (drafts, drafted, accepted) == (0, 0, 0)
        dashboard = httpx.get(f"{server.url}/v1/cache/stats", timeout=30).json()["speculation"]
        assert dashboard["method"] == method
        assert (dashboard["drafts"], dashboard["draft_tokens"], dashboard["accepted_tokens"]) == (
            drafts,
            drafted,
            accepted,
        )
        assert (dashboard["acceptance_rate"] is None) == (drafted == 0)


def test_acceptance_rate_and_accepted_length_are_ratios_of_the_counters(servers: dict[str, Server]) -> None:
    """Known counters through the collector and the dashboard (the engine's own counts depend on what it
    drafted): rate = accepted / draft tokens, length = accepted / drafts, nothing drafted = null."""
    stats = dataclasses.replace(
        servers["suffix"].wait_idle(), spec_drafts=4, spec_draft_tokens=16, spec_accepted_tokens=10
    )
    registry = CollectorRegistry()
    collector = EngineStatsCollector("m")
    collector.stats = stats
    registry.register(collector)
    found = spec_samples(generate_latest(registry).decode())
    assert [found[name][2] for name in SPEC_FAMILIES] == [4, 16, 10]
    shown = speculation_stats(stats, "suffix")
    assert (shown.acceptance_rate, shown.mean_accepted_length) == (10 / 16, 2.5)
    idle = speculation_stats(
        dataclasses.replace(stats, spec_drafts=0, spec_draft_tokens=0, spec_accepted_tokens=0), "off"
    )
    assert (idle.method, idle.acceptance_rate, idle.mean_accepted_length) == ("off", None, None)


COST_FAMILIES = {
    "kvserve_spec_step_fixed_seconds": 0.01,
    "kvserve_spec_decode_row_seconds": 0.004,
    "kvserve_spec_draft_row_seconds": 0.005,
    "kvserve_spec_row_cost": 0.5,
}


def test_the_measured_row_cost_is_on_metrics_the_dashboard_and_only_with_speculation_on(
    servers: dict[str, Server],
) -> None:
    for method, server in servers.items():
        stats = server.wait_idle()
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        families = {f.name for f in text_string_to_metric_families(text)}
        assert (stats.step_costs is not None) == (method == "suffix")
        assert all((name in families) == (method == "suffix") for name in COST_FAMILIES)
        row_cost = speculation_stats(stats, method).row_cost
        assert (row_cost is not None and row_cost > 0) == (method == "suffix")
    costs = StepCosts(fixed=0.01, decode=0.004, draft=0.005, prefill=0.001)
    stats = dataclasses.replace(servers["suffix"].wait_idle(), step_costs=costs)
    registry = CollectorRegistry()
    collector = EngineStatsCollector("m")
    collector.stats = stats
    registry.register(collector)
    text = generate_latest(registry).decode()
    found = {
        f.name: f.samples[0].value for f in text_string_to_metric_families(text) if f.name in COST_FAMILIES
    }
    assert {name: found[name] for name in COST_FAMILIES} == pytest.approx(COST_FAMILIES)
    assert speculation_stats(stats, "suffix").row_cost == pytest.approx(0.5)
