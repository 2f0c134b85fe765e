"""Codex CLI's recorded first request (agent_requests/codex.json), replayed as sent, streamed, against a
real server on the agents' long-context tiny model: its tools arrive in an `additional_tools` input
item (namespaces holding a `custom` tool and function tools), with reasoning.context, text.verbosity
and client_metadata. A second replay with fresh item ids and a fresh prompt_cache_key, as Codex's next
run sends, reads at least 90% of its prompt from the cache: the item ids never reach the prompt."""

import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from tests.server.live import Server, agents_server, assert_no_leak, recorded_request

KEY = "codex-replay-key"
# The headers a replay resends: the recorded ones but the connection's own and the credential.
_NOT_RESENT = {"host", "content-length", "authorization", "accept-encoding", "connection"}


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    return recorded_request("codex")


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[Server]:
    with agents_server(str(tmp_path_factory.mktemp("codex-model")), serve_app, KEY, "gpt-6.2-sol") as server:
        yield server


def _replay(server: Server, headers: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
    """The request streamed; its events checked in order; the final response."""
    sent = {k: v for k, v in headers.items() if k.lower() not in _NOT_RESENT}
    sent["authorization"] = f"Bearer {KEY}"
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, headers=sent, timeout=600) as r:
        text = "".join(r.iter_text())
        assert r.status_code == 200, text[:2000]
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
    final: dict[str, Any] = events[-1]["response"]
    return final


def _fresh_ids(body: dict[str, Any]) -> dict[str, Any]:
    """The body as Codex's next run sends it: every item id and the prompt_cache_key new."""
    items = [{**item, "id": f"{item['id'].split('_')[0]}_{uuid.uuid4()}"} for item in body["input"]]
    return {**body, "input": items, "prompt_cache_key": str(uuid.uuid4())}


def test_codexs_first_request_is_answered_and_its_next_run_is_cached(
    server: Server, recorded: dict[str, Any]
) -> None:
    body = recorded["body"]
    assert body["input"][0]["type"] == "additional_tools"
    first = _replay(server, recorded["headers"], body)
    assert first["store"] is False
    calls = [i for i in first["output"] if i["type"] in ("function_call", "custom_tool_call")]
    offered = {t["name"] for group in body["input"][0]["tools"] for t in group["tools"]}
    assert {c["name"] for c in calls} <= offered
    for call in calls:
        if call["type"] == "custom_tool_call":
            assert call["name"] == "exec" and isinstance(call["input"], str)
    second = _replay(server, recorded["headers"], _fresh_ids(body))
    usage = second["usage"]
    assert usage["input_tokens"] == first["usage"]["input_tokens"]
    assert usage["input_tokens_details"]["cached_tokens"] >= 0.9 * usage["input_tokens"]
    assert_no_leak(server.wait_idle())


def test_a_next_step_with_one_tool_description_changed_reports_tools_and_the_position(
    server: Server, recorded: dict[str, Any]
) -> None:
    body = {**recorded["body"], "max_output_tokens": 4}
    sent = {k: v for k, v in recorded["headers"].items() if k.lower() not in _NOT_RESENT}
    sent["authorization"] = f"Bearer {KEY}"

    def step(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        r = httpx.post(
            f"{server.url}/v1/responses", json={**body, "stream": False}, headers=sent, timeout=600
        )
        assert r.status_code == 200, r.text[:2000]
        figures = dict(field.split("=", 1) for field in r.headers["x-kvserve-cache"].split("; "))
        response: dict[str, Any] = r.json()
        return response, figures

    first, _ = step(body)
    groups = [{**g, "tools": [dict(t) for t in g["tools"]]} for g in body["input"][0]["tools"]]
    groups[0]["tools"][1]["description"] += " Mind the clock."
    changed = [{**body["input"][0], "tools": groups}, *body["input"][1:]]
    options = {"comparison_response_id": first["id"]}
    second, figures = step({**body, "input": changed, "prompt_cache_options": options})
    diagnostics = second["prompt_cache_diagnostics"]
    assert diagnostics["type"] == "cache_miss" and diagnostics["reason"] == "tools_changed", diagnostics
    assert figures["reason"] == "diverged" and figures["part"] == "tools", figures
    assert 0 < int(figures["position"]) < second["usage"]["input_tokens"]
