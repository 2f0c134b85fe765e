"""`make agents`' own parts, without the CLIs: the recording proxy in front of a real kvserve (streams
pass through, a request for another host is refused and recorded, credentials are blanked), the report
joined with kvserve's log lines, the verdict, the long-context tiny model, and the recorded fixtures."""

import json
import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import httpx
import pytest
import torch
from benchmarks.agent_proxy import REDACTED, Exchange, running_proxy
from benchmarks.agents import (
    CONTEXT,
    FIXTURES,
    MEAN_REPLY_TOKENS,
    build_model,
    failures,
    recorded,
    rows,
    table,
    token_counts,
)
from fastapi import FastAPI

from kvserve.config import EngineConfig, default_cache_dir
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.model.loader import load_model
from kvserve.options import ServerOptions
from kvserve.server.app import create_app

KEY = "harness-key-1"
SYSTEM = "You are a careful agent. " * 60


def _chat(url: str, run: str, client: httpx.Client) -> None:
    body = {
        "model": "agent-default-id",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Run {run}."}],
        "max_tokens": 2,
        "stream": True,
    }
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    assert text.rstrip().endswith("data: [DONE]")


@pytest.fixture(scope="module")
def agents_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_model(str(tmp_path_factory.mktemp("agents")))


def test_requests_pass_through_the_proxy_and_the_report_joins_kvserves_log(
    agents_model: str,
    serve_app: Callable[[FastAPI], AbstractContextManager[str]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = load_model(agents_model, default_cache_dir())
    engine = Engine.from_config(EngineConfig(kv_cache_memory=16 * 2**20, max_model_len=2048), model=model)
    async_engine = AsyncEngine(engine)
    options = ServerOptions(api_key=KEY, served_model_name=("kvserve-agents", "agent-default-id"))
    auth = {"Authorization": f"Bearer {KEY}"}
    with (
        caplog.at_level(logging.INFO, logger="kvserve.server"),
        serve_app(create_app(async_engine, options)) as url,
        running_proxy(url) as (proxy, proxy_url),
        httpx.Client(headers=auth, timeout=120) as client,
    ):
        for run in (1, 2):
            proxy.label = f"agent#{run}"
            _chat(proxy_url, str(run), client)
        assert client.post(f"{proxy_url}/v1/no-such-route", json={}).status_code == 404
        # A CLI's connection elsewhere, through the proxy as its HTTPS proxy: refused, never sent.
        with httpx.Client(proxy=proxy_url) as outside, pytest.raises(httpx.ProxyError):
            outside.get("https://example.invalid/telemetry")
    exchanges = proxy.exchanges
    assert [(e.label, e.method, e.path, e.status) for e in exchanges] == [
        ("agent#1", "POST", "/v1/chat/completions", 200),
        ("agent#2", "POST", "/v1/chat/completions", 200),
        ("agent#2", "POST", "/v1/no-such-route", 404),
        ("agent#2", "CONNECT", "example.invalid:443", 403),
    ]
    assert exchanges[0].headers["authorization"] == REDACTED
    assert exchanges[0].body["stream"] is True and exchanges[3].external
    log_text = "\n".join(f"{r.name}: {r.getMessage()}" for r in caplog.records)
    report = rows(exchanges, token_counts(log_text))
    first, second = report[0], report[1]
    assert first.prompt_tokens is not None and first.prompt_tokens == second.prompt_tokens
    assert first.cached_tokens == 0
    assert second.cached_fraction is not None and second.cached_fraction >= 0.9
    assert report[2].prompt_tokens is None and "| 404 |" in table(report)
    problems = failures(report, ["agent"])
    assert problems == [
        "agent#2 POST /v1/no-such-route: HTTP 404",
        "agent#2 CONNECT example.invalid:443: HTTP 403",
    ]


def test_the_second_runs_first_request_must_be_mostly_cached() -> None:
    log_text = (
        "kvserve.server: a: prompt 1000 tokens (0 cached)\nkvserve.server: b: prompt 1000 tokens (899 cached)"
    )
    exchanges = [
        Exchange("cli#1", "POST", "/v1/x", {}, None, 200, "a"),
        Exchange("cli#2", "POST", "/v1/x", {}, None, 200, "b"),
    ]
    assert failures(rows(exchanges, token_counts(log_text)), ["cli", "other"]) == [
        "cli#2's first request (/v1/x): 89.9% cached, under 90%",
        "other#2 made no request",
    ]


def test_a_recorded_request_holds_no_credential() -> None:
    headers = {"x-api-key": REDACTED, "authorization": REDACTED, "anthropic-version": "2023-06-01"}
    body = {"model": "m", "metadata": {"user_id": "device-and-account-hash"}}
    assert recorded(Exchange("cli#1", "POST", "/v1/messages", headers, body))["body"]["metadata"] == {
        "user_id": REDACTED
    }


@pytest.mark.parametrize("name", ["claude_code", "codex"])
def test_the_fixtures_are_requests_without_credentials(name: str) -> None:
    with open(os.path.join(FIXTURES, f"{name}.json")) as f:
        fixture: dict[str, Any] = json.load(f)
    assert fixture["method"] == "POST"
    assert fixture["body"]["stream"] is True
    for header in ("authorization", "x-api-key"):
        assert fixture["headers"].get(header, REDACTED) == REDACTED
    assert fixture["body"].get("metadata", {}).get("user_id", REDACTED) == REDACTED


def test_the_tiny_model_has_the_long_context_and_gives_the_end_token_its_share(agents_model: str) -> None:
    import transformers

    assert build_model(os.path.dirname(agents_model)) == agents_model
    config = load_model(agents_model, default_cache_dir()).config
    assert config.max_position_embeddings == CONTEXT
    model = transformers.AutoModelForCausalLM.from_pretrained(agents_model)
    ids = torch.randint(0, config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        probabilities = model(ids).logits[0].softmax(-1)
    [eos] = config.eos_token_ids
    # Sampled at temperature 1, a reply ends after about MEAN_REPLY_TOKENS tokens, at every position.
    share = probabilities[:, eos]
    assert share.min() > 0.5 / MEAN_REPLY_TOKENS and share.max() < 2 / MEAN_REPLY_TOKENS, share
    # And the rest is spread: no other token takes the place of the end token's.
    others = probabilities.clone()
    others[:, eos] = 0
    assert others.max() < 0.01
