"""The cache dashboard's JSON (`GET /v1/cache/stats`) against the engine after known traffic, the page's
files, access with a key, and the bounded hot-prefix set it reads."""

import re
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import httpx
import pytest
from fastapi import FastAPI

from kvserve.cache.block_pool import BlockPool
from kvserve.cache.prefix_cache import PrefixCache
from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.snapshot import take_snapshot
from kvserve.model.loader import LoadedModel
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from kvserve.server.cache_api.dashboard import HEAD_TOKENS, StatsHistory, render

Serve = Callable[[FastAPI], AbstractContextManager[str]]
SYSTEM = list(range(200, 264))  # 64 tokens: four whole blocks of 16


def _engine(model: LoadedModel) -> Engine:
    return Engine.from_config(
        EngineConfig(kv_cache_memory=4 * 2**20, max_model_len=256, weight_dtype="float32"), model=model
    )


def _complete(url: str, prompt: list[int], max_tokens: int = 3) -> dict[str, object]:
    request = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=request, timeout=60)
    assert r.status_code == 200, r.text
    body: dict[str, object] = r.json()
    return body


def _stats(url: str, **headers: str) -> httpx.Response:
    return httpx.get(f"{url}/v1/cache/stats", headers=headers, timeout=30)


@pytest.mark.usefixtures("one_thread")
def test_stats_json_matches_hand_counts_after_known_traffic(
    tiny_model: LoadedModel, serve_app: Serve
) -> None:
    engine = _engine(tiny_model)
    with serve_app(create_app(AsyncEngine(engine), ServerOptions())) as url:
        for user in ([300, 301, 302], [400, 401], [500, 501, 502, 503]):
            _complete(url, [*SYSTEM, *user])
        body = _stats(url).json()
        # Counted by hand: prompts of 67, 66 and 68 tokens; the first hits nothing, the later two hit the
        # 64-token system prompt (four whole blocks; their own tokens differ from the first token on).
        assert body["counters"] == {
            "prompt_tokens": 201,
            "generation_tokens": 9,
            "cache_queries": 201,
            "cache_hits": 128,
            "prefill_tokens_computed": 73,
            "saved_prefill_tokens": 128,
            "hit_rate": pytest.approx(128 / 201),
            "preemptions": 0,
        }
        # The tiny model's KV: 2 layers x (K, V) x 2 heads x 16 dims x 2 bytes (float16) = 256 bytes a
        # token, 4 KiB a 16-token block, so 4 MiB hold 1,024 blocks. Cached: the system prompt's four
        # blocks, and each request's tail block (its last 3 + 2 generated tokens hold KV: the third
        # generated token is never fed back). No request runs: usage (the fraction they hold) is 0.
        pool = body["pool"]
        assert (pool["blocks"], pool["block_size"], pool["usage"]) == (1024, 16, 0.0)
        assert (pool["free"], pool["cached"], pool["in_use"], pool["pinned"], pool["evicted"]) == (
            1017,
            7,
            0,
            0,
            0,
        )
        assert pool["tiers"] == []
        # The two later requests hit the shared system prompt: one branch, 64 tokens, 2 hits.
        top = body["branches"][0]
        assert (top["tokens"], top["hits"], top["namespace"], top["text"]) == (64, 2, "default", None)
        assert body["requests"] == [] and body["num_requests"] == 0
        # The sampler adds a point a second; the chart is built from them.
        # Sampled once a second, so the traffic's last counts show up within a second or two.
        deadline = time.monotonic() + 30
        history = _stats(url).json()["history"]
        while (not history or history[-1]["cache_hits"] != 128) and time.monotonic() < deadline:
            time.sleep(0.2)
            history = _stats(url).json()["history"]
        assert (history[-1]["cache_queries"], history[-1]["cache_hits"]) == (201, 128)
        assert history[-1]["prefill_tokens_computed"] == 73
        assert [p["cache_hits"] for p in history] == sorted(p["cache_hits"] for p in history)


@pytest.mark.usefixtures("one_thread")
def test_branch_text_is_shown_only_when_asked(tiny_model: LoadedModel, serve_app: Serve) -> None:
    for show in (False, True):
        with serve_app(
            create_app(AsyncEngine(_engine(tiny_model)), ServerOptions(dashboard_show_text=show))
        ) as url:
            _complete(url, [*SYSTEM, 300])
            _complete(url, [*SYSTEM, 301])
            text = _stats(url).json()["branches"][0]["text"]
            assert text == (tiny_model.tokenizer.decode(SYSTEM[:HEAD_TOKENS]) if show else None)


@pytest.mark.usefixtures("one_thread")
def test_running_and_waiting_requests_are_listed_running_first(tiny_model: LoadedModel) -> None:
    engine = Engine.from_config(
        EngineConfig(kv_cache_memory=4 * 2**20, max_model_len=256, weight_dtype="float32", max_num_seqs=1),
        model=tiny_model,
    )
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    engine.add_request("first", SYSTEM, params)
    engine.add_request("second", [*SYSTEM, 7], params, namespace="tenant-b")
    for _ in range(3):
        engine.step()
    body = render(take_snapshot(engine), "tiny", StatsHistory.empty(), None, "off")
    first, second = body.requests
    assert (first.id, first.status, first.prompt_tokens, first.cached_tokens) == ("first", "running", 64, 0)
    assert first.generated_tokens == 3 and first.ttft_s is not None and first.ttft_s > 0
    assert (second.id, second.status, second.cached_tokens, second.ttft_s) == (
        "second",
        "waiting",
        None,
        None,
    )
    assert second.namespace == "tenant-b" and body.num_requests == 2
    (mine,) = take_snapshot(engine, namespace="tenant-b").requests
    assert mine.request_id == "second"
    for rid in ("first", "second"):
        engine.abort_request(rid)


def test_the_page_and_its_files_are_served_and_the_data_needs_the_key(
    tiny_model: LoadedModel, serve_app: Serve
) -> None:
    with serve_app(create_app(AsyncEngine(_engine(tiny_model)), ServerOptions(api_key="sesame-key"))) as url:
        page = httpx.get(f"{url}/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        for section in ("pool-usage", "hit-rate", "prefix-tree", "requests"):
            assert f'id="{section}"' in page.text
        assert (
            httpx.get(f"{url}/dashboard/dashboard.js").headers["content-type"].startswith("text/javascript")
        )
        assert httpx.get(f"{url}/dashboard/dashboard.css").status_code == 200
        assert httpx.get(f"{url}/dashboard/secrets.txt").status_code == 404
        assert _stats(url).status_code == 401
        assert _stats(url, Authorization="Bearer sesame-key").status_code == 200


def test_hot_branches_are_bounded_ranked_and_forget_evicted_prefixes() -> None:
    pool = BlockPool(64)
    cache = PrefixCache(pool, 2)
    cache.HOT_LIMIT = 3
    paths = {}
    for i in range(8):
        tokens = [i, i, i, i, 9, 9][: 2 + 2 * (i % 3)]
        blocks = pool.allocate(len(tokens) // 2)
        cache.insert("a" if i % 2 else "b", tokens, blocks)
        for b in blocks:
            pool.release(b)
        paths[i] = tokens
        for _ in range(i + 1):
            cache.match("a" if i % 2 else "b", tokens)
    # Pruned whenever it doubles past HOT_LIMIT, keeping the heaviest.
    assert len(cache._hot) <= 2 * cache.HOT_LIMIT
    # Weights (tokens x hits) of paths 0..7: 2, 8, 18, 8, 20, 36, 14, 32.
    top = cache.hot_branches(3)
    assert [(b.num_tokens, b.hits) for b in top] == [(6, 6), (4, 8), (4, 5)]
    assert {b.namespace for b in cache.hot_branches(10, "a")} == {"a"}
    assert cache.match("a", paths[5], record_hit=False).num_tokens == 6
    assert cache.hot_branches(1)[0].hits == 6
    cache.reset()
    assert cache.hot_branches(10) == []


def test_hot_branches_form_a_tree_with_one_trunk_for_a_shared_prompt() -> None:
    """Two conversations over one system prompt: the prompt is listed once, as the trunk, though no match
    ended at it; each conversation is a branch of it, headed by the tokens where it parts."""
    pool = BlockPool(32)
    cache = PrefixCache(pool, 2)
    system = [1, 2, 3, 4]
    chats = [[*system, 10, 11, 12, 13], [*system, 20, 21]]
    for tokens in chats:
        blocks = pool.allocate(len(tokens) // 2)
        cache.insert("", tokens, blocks)
        for b in blocks:
            pool.release(b)
    for _ in range(3):
        cache.match("", [*chats[0], 99])
    cache.match("", [*chats[1], 99])
    assert [(b.num_tokens, b.hits, b.parent, b.start, b.head) for b in cache.hot_branches(10)] == [
        (8, 3, 2, 4, (10, 11)),
        (6, 1, 2, 4, (20, 21)),
        (4, 0, None, 0, (1, 2)),
    ]
    # A branch alone is a root, headed by its first tokens, as before.
    assert [(b.parent, b.start, b.head) for b in cache.hot_branches(1)] == [(None, 0, (1, 2))]


def test_a_partial_prefix_that_grows_keeps_its_hits() -> None:
    """A chat's reply tail is a partial block; the next turn's full block replaces it, hits included."""
    pool = BlockPool(8)
    cache = PrefixCache(pool, 4)

    def publish(tokens: list[int]) -> None:
        blocks = pool.allocate(len(tokens) // 4 + 1)
        cache.insert("", tokens, blocks)
        for b in blocks:
            pool.release(b)

    publish([1, 2, 3, 4, 5, 6])
    cache.match("", [1, 2, 3, 4, 5, 6, 7])
    assert [(b.num_tokens, b.hits) for b in cache.hot_branches(5)] == [(6, 1)]
    publish([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert [(b.num_tokens, b.hits) for b in cache.hot_branches(5)] == [(8, 1)]


def test_chat_stats_prints_the_dashboards_numbers() -> None:
    argv = [sys.executable, "-m", "kvserve", "chat", "--kv-cache-memory", "64MiB", "--max-tokens", "3"]
    argv += ["--system", "You are terse.", "--threads", "1"]
    done = subprocess.run(
        argv, input="hello\nhello again\n/stats\n", capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    (pool,) = [line for line in done.stderr.splitlines() if line.startswith("pool: ")]
    (cache,) = [line for line in done.stderr.splitlines() if line.startswith("prefix cache: ")]
    assert " 0 in use" in pool and "0 evicted" in pool
    hit = re.search(r"([\d.]+)% of (\d+) prompt tokens hit, (\d+) prefill tokens saved", cache)
    assert hit is not None and float(hit[1]) > 0 and int(hit[3]) > 0
    assert "You are terse." in done.stderr.split(cache)[1]
