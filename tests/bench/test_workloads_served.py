"""kvserve bench: pure parts without a server, then every workload against real kvserve servers."""

import io
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import matplotlib.image
import pytest
from PIL import Image

from kvserve_bench import workloads
from kvserve_bench.client import parse_target
from kvserve_bench.errors import BenchError
from kvserve_bench.metrics_scrape import parse_samples, prefix_cache_delta
from kvserve_bench.report import Distribution, percentile
from kvserve_bench.sharegpt import iter_dataset, iter_objects
from kvserve_bench.tokens import text_of_tokens, text_only
from kvserve_bench.workloads import MultiturnSpec, SharedPrefixSpec, SharegptSpec
from tests.bench.cli_runs import bench, targets

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
REQUEST_FIELDS = {
    "target",
    "conversation",
    "group",
    "turn",
    "start_s",
    "ttft_s",
    "itl_s",
    "e2e_s",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "finish_reason",
    "draft_tokens",
    "accepted_tokens",
    "reply",
    "greedy_loop",
    "retries",
    "error",
}
TARGET_FIELDS = {
    "name",
    "url",
    "model",
    "requests",
    "errors",
    "first_error",
    "retried",
    "recovered",
    "ttft_s",
    "itl_s",
    "e2e_s",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "cached_fraction",
    "server_prefix_cache_queries",
    "server_prefix_cache_hits",
    "server_hit_rate",
    "busy_s",
    "requests_per_s",
    "output_tokens_per_s",
    "per_turn",
    "tpot_s",
    "speculation_source",
    "spec_drafts",
    "spec_draft_tokens",
    "spec_accepted_tokens",
    "acceptance_rate",
    "mean_accepted_length",
    "greedy_loops",
    "loops_checked",
}


def count_words(text: str) -> int:
    return len(text.split())


# ---------------------------------------------------------------------------------------------------------
# Pure parts


def test_text_of_tokens_is_exact_and_seeded() -> None:
    for n in (0, 1, 7, 300):
        assert count_words(text_of_tokens(n, "k", count_words)) == n
    assert text_of_tokens(50, "a", count_words) == text_of_tokens(50, "a", count_words)
    assert text_of_tokens(50, "a", count_words) != text_of_tokens(50, "b", count_words)


def test_text_of_tokens_reaches_n_when_some_words_are_several_tokens() -> None:
    def count(text: str) -> int:
        return sum(3 if len(word) > 7 else 1 for word in text.split())

    for n in (1, 10, 99):
        assert count(text_of_tokens(n, "long words", count)) == n


def test_text_only_leaves_out_special_tokens() -> None:
    with_bos = text_only(lambda text: 1 + count_words(text))
    assert with_bos(text_of_tokens(20, "k", with_bos)) == 20
    assert count_words(text_of_tokens(20, "k", with_bos)) == 20


def test_multiturn_is_reproducible_and_sized() -> None:
    spec = MultiturnSpec(conversations=3, turns=4, system_tokens=30, user_tokens=12, seed=5)
    first = workloads.multiturn(spec, count_words)
    assert first == workloads.multiturn(spec, count_words)
    assert first != workloads.multiturn(MultiturnSpec(conversations=3, turns=4, seed=6), count_words)
    assert first.num_requests == 12
    assert len({c.system for c in first.conversations}) == 1
    for c in first.conversations:
        assert count_words(c.system or "") == 30
        assert [count_words(t) for t in c.user_turns] == [12] * 4
    unique = workloads.multiturn(MultiturnSpec(conversations=3, shared_system=False), count_words)
    assert len({c.system for c in unique.conversations}) == 3
    assert len({c.group for c in unique.conversations}) == 3


def test_shared_prefix_groups_and_poisson_arrivals() -> None:
    spec = SharedPrefixSpec(
        groups=3, prompts_per_group=4, system_tokens=20, question_tokens=5, request_rate=2.0
    )
    workload = workloads.shared_prefix(spec, count_words)
    assert workload == workloads.shared_prefix(spec, count_words)
    assert workload.max_in_flight == 12
    by_group: dict[int, set[str | None]] = {}
    for c in workload.conversations:
        by_group.setdefault(c.group, set()).add(c.system)
        assert len(c.user_turns) == 1 and count_words(c.user_turns[0]) == 5
    assert sorted(by_group) == [0, 1, 2] and all(len(s) == 1 for s in by_group.values())
    arrivals = [c.arrival_s for c in workload.conversations]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and arrivals[-1] > 0
    at_once = workloads.shared_prefix(SharedPrefixSpec(groups=2, prompts_per_group=2), count_words)
    assert {c.arrival_s for c in at_once.conversations} == {0.0}
    assert at_once.settings["request_rate"] == "inf"
    with pytest.raises(BenchError):
        workloads.shared_prefix(SharedPrefixSpec(request_rate=0), count_words)


def test_iter_objects_stops_at_the_truncated_object() -> None:
    text = '[\n {"id": "a", "n": [1, 2]},\n {"id": "b", "s": "x,}y"}, {"id": "c", "conv'
    for chunk in (3, 7, 1000):
        assert [o["id"] for o in iter_objects(io.StringIO(text), chunk)] == ["a", "b"]
    assert [o["id"] for o in iter_objects(io.StringIO('[{"id": "a"}]'), 4)] == ["a"]


def test_sharegpt_data_set_reads_and_builds_a_workload() -> None:
    head = []
    for turns in iter_dataset():
        head.append(turns)
        if len(head) == 50:
            break
    assert all(isinstance(t, str) for turns in head for t in turns)
    spec = SharegptSpec(conversations=3, min_turns=2, max_turns=3, max_user_tokens=100, seed=1)
    workload = workloads.sharegpt(spec, count_words, head)
    assert workload == workloads.sharegpt(spec, count_words, head)
    for c in workload.conversations:
        assert 2 <= len(c.user_turns) <= 3 and c.system is None
        assert all(count_words(t) <= 100 for t in c.user_turns)
    with pytest.raises(BenchError, match="ShareGPT conversations"):
        workloads.sharegpt(SharegptSpec(conversations=1000), count_words, head)


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([], 50) is None
    assert percentile([4.0], 99) == 4.0
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile(list(range(101)), 90) == 90
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    d = Distribution.of([1.0, 3.0])
    assert [d.p50, d.p90, d.p99, d.mean] == pytest.approx([2.0, 2.8, 2.98, 2.0])
    assert Distribution.of([]) == Distribution(None, None, None, None)


def test_metrics_parsing_and_prefix_cache_delta() -> None:
    text = (
        "# TYPE vllm:prefix_cache_queries counter\n"
        'vllm:prefix_cache_queries_total{model_name="m",engine="0"} 100.0\n'
        'vllm:prefix_cache_queries_total{model_name="m",engine="1"} 50.0\n'
        'vllm:prefix_cache_queries_created{model_name="m"} 1.7e9\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{model_name="m"} 30.0\n'
    )
    before = parse_samples(text)
    assert before == {"vllm:prefix_cache_queries": 150.0, "vllm:prefix_cache_hits": 30.0}
    after = {"vllm:prefix_cache_queries": 350.0, "vllm:prefix_cache_hits": 130.0}
    delta = prefix_cache_delta(before, after)
    assert delta is not None and (delta.queries, delta.hits, delta.hit_rate) == (200.0, 100.0, 0.5)
    assert prefix_cache_delta(None, after) is None
    assert prefix_cache_delta(before, {"other": 1.0}) is None


def test_parse_target() -> None:
    t = parse_target("cache=http://127.0.0.1:8000/v1/")
    assert (t.name, t.url) == ("cache", "http://127.0.0.1:8000")
    assert parse_target("http://host:9").name == "host:9"
    with pytest.raises(BenchError):
        parse_target("peer=localhost:8000")


# ---------------------------------------------------------------------------------------------------------
# Against real kvserve servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(port: int, log: Path, *flags: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "kvserve", "serve", "--port", str(port), "--kv-cache-memory", "256MiB"]
    with log.open("wb") as out:
        return subprocess.Popen([*command, *flags], stdout=out, stderr=subprocess.STDOUT)


def wait_healthy(process: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, f"kvserve serve exited:\n{log.read_text()[-2000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"kvserve serve was not healthy after 120 s:\n{log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Two kvserve servers, one with the prefix cache and one without; name -> base URL."""
    logs = tmp_path_factory.mktemp("server-logs")
    ports = {"cache": free_port(), "nocache": free_port()}
    processes = {
        "cache": start_server(ports["cache"], logs / "cache.log"),
        "nocache": start_server(ports["nocache"], logs / "nocache.log", "--no-prefix-cache"),
    }
    try:
        urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        for name, process in processes.items():
            wait_healthy(process, urls[name], logs / f"{name}.log")
        yield urls
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()


def check_report(path: Path, requests: int, target_names: list[str]) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(path.read_text())
    assert {"workload", "description", "settings", "started_at", "machine", "targets", "requests"} <= set(
        report
    )
    assert report["settings"]["seed"] == 0 and report["settings"]["tokenizer"]
    assert [t["name"] for t in report["targets"]] == target_names
    for target in report["targets"]:
        assert set(target) == TARGET_FIELDS
        assert target["errors"] == 0 and target["requests"] == requests
        assert target["ttft_s"]["p50"] > 0 and target["output_tokens_per_s"] > 0
    assert len(report["requests"]) == requests * len(target_names)
    for r in report["requests"]:
        assert set(r) == REQUEST_FIELDS and r["error"] is None
        assert r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"]
        assert 0 <= r["cached_tokens"] <= r["prompt_tokens"] and r["completion_tokens"] >= 1
    return report


def check_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] > 100
    assert matplotlib.image.imread(path).ndim == 3


def cached_by_turn(report: dict[str, Any], target: str) -> dict[str, list[int]]:
    turns: dict[str, list[tuple[int, int]]] = {}
    for r in report["requests"]:
        if r["target"] == target:
            turns.setdefault(r["conversation"], []).append((r["turn"], r["cached_tokens"]))
    return {c: [cached for _, cached in sorted(t)] for c, t in turns.items()}


def test_multiturn_cached_tokens_grow_only_with_the_cache(servers: dict[str, str], tmp_path: Path) -> None:
    rc = bench(
        "multiturn",
        *targets(servers, "cache", "nocache"),
        *("--conversations", "2", "--turns", "3", "--system-tokens", "64", "--user-tokens", "24"),
        *("--reply-tokens", "8", "--max-in-flight", "2", "--out", str(tmp_path)),
    )
    assert rc == 0
    report = check_report(tmp_path / "multiturn.json", 6, ["cache", "nocache"])
    for turns in cached_by_turn(report, "cache").values():
        assert turns[1] > 0 and turns == sorted(turns) and turns[2] > turns[1]
    assert all(turns == [0, 0, 0] for turns in cached_by_turn(report, "nocache").values())
    cache, nocache = report["targets"]
    assert cache["cached_fraction"] > 0 and nocache["cached_fraction"] == 0
    assert cache["server_prefix_cache_hits"] > 0 and nocache["server_prefix_cache_hits"] == 0
    assert [t["turn"] for t in cache["per_turn"]] == [1, 2, 3]
    assert all(t["itl_p50_s"] > 0 and t["e2e_p50_s"] > 0 for t in cache["per_turn"])
    check_png(tmp_path / "multiturn-ttft.png")
    check_png(tmp_path / "multiturn-cached.png")
    check_png(tmp_path / "multiturn-latency.png")
    assert "| TTFT p50 / p90 / p99 (ms) |" in (tmp_path / "multiturn.md").read_text()


def test_shared_prefix_hits_after_a_group_mate_finished(servers: dict[str, str], tmp_path: Path) -> None:
    rc = bench(
        "shared-prefix",
        *targets(servers, "cache", "nocache"),
        *("--groups", "2", "--prompts-per-group", "3", "--system-tokens", "64", "--question-tokens", "16"),
        *("--output-tokens", "8", "--request-rate", "2", "--out", str(tmp_path)),
    )
    assert rc == 0
    report = check_report(tmp_path / "shared-prefix.json", 6, ["cache", "nocache"])
    cache = [r for r in report["requests"] if r["target"] == "cache"]
    for r in cache:
        # Arrivals are open-loop, so which requests overlap depends on timing; but a request that started
        # after one of its group finished must find that group's system prompt in the cache.
        if any(o["group"] == r["group"] and o["start_s"] + o["e2e_s"] < r["start_s"] for o in cache):
            assert r["cached_tokens"] >= 64
    assert all(r["cached_tokens"] == 0 for r in report["requests"] if r["target"] == "nocache")
    check_png(tmp_path / "shared-prefix-ttft.png")
    check_png(tmp_path / "shared-prefix-cached.png")


def test_sharegpt_replays_real_conversations(servers: dict[str, str], tmp_path: Path) -> None:
    rc = bench(
        "sharegpt",
        *targets(servers, "cache"),
        *("--conversations", "2", "--min-turns", "2", "--max-turns", "2", "--max-user-tokens", "48"),
        *("--reply-tokens", "8", "--out", str(tmp_path)),
    )
    assert rc == 0
    report = check_report(tmp_path / "sharegpt.json", 4, ["cache"])
    assert all(turns[1] > 0 for turns in cached_by_turn(report, "cache").values())
    check_png(tmp_path / "sharegpt-ttft.png")


def test_refused_connection_is_one_clear_line(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvserve",
            "bench",
            "multiturn",
            "--target",
            f"down={url}",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "refused the connection" in lines[0] and url in lines[0]
