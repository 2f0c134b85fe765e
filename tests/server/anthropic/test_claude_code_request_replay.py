"""Claude Code's recorded first request (agent_requests/claude_code.json), replayed as sent, streamed,
against a real server on the agents' long-context tiny model: `?beta=true`, x-api-key, max_tokens
128,000, system blocks with cache_control, a `system`-role message after the user's, 12 tools, adaptive
thinking, context_management and output_config. Its next run (a new metadata.user_id, as Claude Code
sends) reads at least 90% of its prompt from the cache."""

import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from tests.server.live import Server, agents_server, assert_no_leak, recorded_request

KEY = "claude-code-replay-key"
# The headers a replay resends: the recorded ones but the connection's own and the credential.
_NOT_RESENT = {"host", "content-length", "x-api-key", "accept-encoding", "connection"}


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    return recorded_request("claude_code")


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[Server]:
    with agents_server(
        str(tmp_path_factory.mktemp("claude-model")), serve_app, KEY, "claude-opus-5-5"
    ) as server:
        yield server


def _replay(server: Server, recorded: dict[str, Any], body: dict[str, Any]) -> dict[str, int]:
    """The request streamed as Claude Code sends it; its events checked in order; the prompt's usage."""
    headers = {k: v for k, v in recorded["headers"].items() if k.lower() not in _NOT_RESENT}
    headers["x-api-key"] = KEY
    url = f"{server.url}{recorded['path']}"
    with httpx.stream("POST", url, json=body, headers=headers, timeout=600) as r:
        text = "".join(r.iter_text())
        assert r.status_code == 200, text[:2000]
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    usage: dict[str, int] = events[0]["message"]["usage"]
    return usage


def test_claude_codes_first_request_is_answered_and_its_next_run_is_cached(
    server: Server, recorded: dict[str, Any]
) -> None:
    body = recorded["body"]
    assert [m["role"] for m in body["messages"]][-1] == "system" and body["max_tokens"] > 32768
    first = _replay(server, recorded, body)
    prompt = first["input_tokens"] + first["cache_read_input_tokens"] + first["cache_creation_input_tokens"]
    assert prompt > 8192 and first["cache_read_input_tokens"] == 0
    second = _replay(server, recorded, {**body, "metadata": {"user_id": "another-run"}})
    total = second["input_tokens"] + second["cache_read_input_tokens"] + second["cache_creation_input_tokens"]
    assert total == prompt
    assert second["cache_read_input_tokens"] >= 0.9 * prompt
    assert_no_leak(server.wait_idle())


def _diagnosed(server: Server, recorded: dict[str, Any], body: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The request streamed with a short reply; its `message_start` message and the cache header."""
    headers = {k: v for k, v in recorded["headers"].items() if k.lower() not in _NOT_RESENT}
    headers["x-api-key"] = KEY
    with httpx.stream(
        "POST", f"{server.url}{recorded['path']}", json=body, headers=headers, timeout=600
    ) as r:
        text = "".join(r.iter_text())
        assert r.status_code == 200, text[:2000]
        header = r.headers["x-kvserve-cache"]
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    message: dict[str, Any] = events[0]["message"]
    return message, header


def test_a_next_step_with_one_tool_description_changed_reports_tools_and_the_position(
    server: Server, recorded: dict[str, Any]
) -> None:
    body = {**recorded["body"], "max_tokens": 4}
    first, _ = _diagnosed(server, recorded, {**body, "diagnostics": {"previous_message_id": None}})
    assert first["diagnostics"]["cache_miss_reason"] is None
    tools = [dict(t) for t in body["tools"]]
    tools[4]["description"] += " Mind the file's size."
    asked = {**body, "tools": tools, "diagnostics": {"previous_message_id": first["id"]}}
    second, header = _diagnosed(server, recorded, asked)
    reason = second["diagnostics"]["cache_miss_reason"]
    assert reason["type"] == "tools_changed" and reason["cache_missed_input_tokens"] > 0, reason
    figures = dict(field.split("=", 1) for field in header.split("; "))
    assert figures["reason"] == "diverged" and figures["part"] == "tools", figures
    assert (
        0
        < int(figures["position"])
        < second["usage"]["input_tokens"] + second["usage"]["cache_read_input_tokens"]
    )
