"""A server killed with SIGKILL and started again on the same --kv-disk folder finds a 2,000-token
system prompt on disk: the first chat after the restart is served mostly from the cache, with the same
greedy text as the first server computed from scratch (its cache was empty, as a no-cache server's is)."""

import sys
import time
from pathlib import Path
from typing import Any

import httpx

from kvserve.model.loader import load_default_tokenizer
from kvserve_bench.tokens import text_of_tokens
from tests.helpers import free_port, server_process

SYSTEM_TOKENS = 2000


def chat(url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def wait_for_disk(url: str, blocks: int) -> None:
    """The disk tier writes behind; wait until the prompt's blocks are on disk (or fail)."""
    deadline = time.monotonic() + 120
    while True:
        tiers = {t["name"]: t for t in httpx.get(f"{url}/v1/cache", timeout=30).json()["tiers"]}
        if tiers["disk"]["blocks"] >= blocks:
            return
        assert time.monotonic() < deadline, f"the disk tier never reached {blocks} blocks: {tiers}"
        time.sleep(0.2)


def test_a_sigkilled_server_restarts_with_its_cache_on_disk(tmp_path: Path) -> None:
    tokenizer = load_default_tokenizer()
    system = text_of_tokens(SYSTEM_TOKENS, "restart", lambda t: len(tokenizer.encode(t, False)))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is this about?"}]
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "kvserve",
        "serve",
        "--port",
        str(port),
        "--kv-cache-memory",
        "256MiB",
        "--kv-disk",
        str(tmp_path / "kv"),
        "--max-pinned-tokens",
        "2048",
    ]
    with server_process(argv, port) as (process, url):
        first = chat(url, messages)
        prompt_tokens = first["usage"]["prompt_tokens"]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        wait_for_disk(url, prompt_tokens // 16 - 1)
        process.kill()
        process.wait()
    with server_process(argv, port) as (process, url):
        again = chat(url, messages)
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 0.9 * prompt_tokens, (cached, prompt_tokens)
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        # The system prompt, pinned by its messages, is found in memory without recomputing.
        pin = httpx.post(f"{url}/v1/cache/pin", json={"messages": messages[:1], "ttl_s": 60}, timeout=300)
        assert pin.status_code == 200, pin.text
        assert pin.json()["pinned_tokens"] >= SYSTEM_TOKENS
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        disk_hits = 'kvserve_prefix_cache_hits_by_tier_total{model_name="SmolLM2-135M-Instruct",tier="disk"}'
        assert f"{disk_hits} {float(cached)}" in metrics
