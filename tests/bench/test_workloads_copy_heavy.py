"""The copy-heavy workloads (repeat, code-edit, agent-loop), the greedy-loop check and the speculation
figures of `kvserve bench`: their shapes without a server, then short real runs against kvserve with
speculation on and off."""

import ast
import itertools
import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from hypothesis import given
from hypothesis import strategies as st

from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.model.loader import LoadedModel, load_default_tokenizer
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from kvserve_bench import workloads
from kvserve_bench.client import RequestResult, Target
from kvserve_bench.errors import BenchError
from kvserve_bench.loops import LOOP_MIN_SPAN, loop_span
from kvserve_bench.metrics_scrape import SpeculationDelta, parse_samples, speculation_delta
from kvserve_bench.report import (
    acceptance_cell,
    accepted_length_cell,
    figure_value,
    markdown,
    summarize,
)
from kvserve_bench.runner import TargetRun
from kvserve_bench.workloads import AgentLoopSpec, CodeEditSpec, RepeatSpec
from tests.bench.cli_runs import bench, targets

# ---------------------------------------------------------------------------------------------------------
# Shapes


def test_repeat_asks_for_a_list_then_for_the_same_answer_one_conversation_at_a_time() -> None:
    workload = workloads.repeat(RepeatSpec(conversations=5, reply_tokens=300))
    assert workload == workloads.repeat(RepeatSpec(conversations=5, reply_tokens=300))
    assert (workload.max_in_flight, workload.max_tokens, workload.ignore_eos) == (1, 300, False)
    assert (workload.figure, workload.figure_turn) == ("tpot", 2)
    topics = set()
    for c in workload.conversations:
        first, again = c.user_turns
        assert "numbered list" in first and again == workloads.REPEAT_AGAIN and c.system is None
        topics.add(first)
    assert len(topics) == 5
    other = workloads.repeat(RepeatSpec(conversations=5, seed=1))
    assert {c.user_turns for c in other.conversations} != {c.user_turns for c in workload.conversations}
    with pytest.raises(BenchError, match="at most"):
        workloads.repeat(RepeatSpec(conversations=len(workloads.REPEAT_TOPICS) + 1))


def test_code_edit_sends_a_file_of_1_to_2k_tokens_and_renames_one_of_its_functions() -> None:
    source = workloads.code_edit_source()
    assert 1000 <= len(load_default_tokenizer().encode(source)) <= 2000
    functions = {node.name for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}
    for old, new in workloads.CODE_EDIT_RENAMES:
        assert old in functions and new not in source
    workload = workloads.code_edit(CodeEditSpec(conversations=3))
    assert (workload.max_in_flight, workload.max_tokens, workload.ignore_eos) == (1, 1000, False)
    renames = set()
    for c in workload.conversations:
        (prompt,) = c.user_turns
        assert source in prompt
        renames.add(prompt.split("Rename the function", 1)[1])
    assert len(renames) == 3
    with pytest.raises(BenchError, match="at most"):
        workloads.code_edit(CodeEditSpec(conversations=len(workloads.CODE_EDIT_RENAMES) + 1))


def test_agent_loop_history_holds_tool_results_and_each_turn_quotes_another() -> None:
    workload = workloads.agent_loop(AgentLoopSpec(conversations=2, turns=4))
    assert workload == workloads.agent_loop(AgentLoopSpec(conversations=2, turns=4))
    assert workload != workloads.agent_loop(AgentLoopSpec(conversations=2, turns=4, seed=1))
    assert (workload.max_in_flight, workload.ignore_eos, workload.figure) == (1, False, "tpot")
    first, second = workload.conversations
    assert first.opening != second.opening
    for c in workload.conversations:
        task, *trace = c.opening
        assert task["role"] == "user"
        called = {}
        for call, result in zip(trace[::2], trace[1::2], strict=True):
            assert call["role"] == "assistant" and call["content"] is None
            (tool_call,) = call["tool_calls"]
            json.loads(tool_call["function"]["arguments"])
            assert result == {"role": "tool", "tool_call_id": tool_call["id"], "content": result["content"]}
            called[tool_call["function"]["name"]] = result["content"]
        assert set(called) == set(workloads.AGENT_ASKS)
        for name in ("get_order", "get_shipment", "get_customer"):
            assert isinstance(json.loads(called[name]), dict)
        asked = [name for turn in c.user_turns for name in called if name in turn]
        assert len(asked) == 4 and len(set(asked)) == 4
    with pytest.raises(BenchError, match="at most"):
        workloads.agent_loop(AgentLoopSpec(turns=len(workloads.AGENT_ASKS) + 1))


# ---------------------------------------------------------------------------------------------------------
# The greedy-loop check


def test_a_reply_ends_in_a_loop_when_a_span_of_8_or_more_tokens_ends_it_three_times() -> None:
    span = list(range(100, 108))
    assert loop_span([1, 2, 3, *span * 3]) == 8
    assert loop_span([1, 2, 3, *span * 2]) is None  # twice is not a loop
    assert loop_span([*span * 3, 5]) is None  # the loop must end the reply
    assert loop_span([1, *span * 3, *span[:5]]) == 8  # cut short by the token limit
    assert loop_span([7] * 24) == 8 and loop_span([7] * 23) is None
    short = [1, 2, 3, 4, 5, 6, 7]
    assert loop_span(short * 3) is None  # a 7-token span three times is too short
    assert loop_span(list(range(300))) is None and loop_span([]) is None


@given(
    head=st.lists(st.integers(0, 50), max_size=30),
    span=st.lists(st.integers(0, 50), min_size=LOOP_MIN_SPAN, max_size=20),
    repeats=st.integers(3, 5),
    cut=st.integers(0, 19),
)
def test_every_reply_that_repeats_a_span_to_its_end_is_found(
    head: list[int], span: list[int], repeats: int, cut: int
) -> None:
    found = loop_span([*head, *span * repeats, *span[: cut % len(span)]])
    assert found is not None and found <= len(span)


# ---------------------------------------------------------------------------------------------------------
# Speculation figures


def test_speculation_counters_are_read_under_vllms_and_llama_cpps_names() -> None:
    vllm = parse_samples(
        "# TYPE vllm:spec_decode_num_drafts counter\n"
        'vllm:spec_decode_num_drafts_total{model_name="m"} 10.0\n'
        "# TYPE vllm:spec_decode_num_draft_tokens counter\n"
        'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 40.0\n'
        "# TYPE vllm:spec_decode_num_accepted_tokens counter\n"
        'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 30.0\n'
    )
    before = dict.fromkeys(vllm, 0.0) | {"vllm:spec_decode_num_drafts": 2.0}
    delta = speculation_delta(before, vllm)
    assert delta == SpeculationDelta(8.0, 40.0, 30.0)
    assert (delta.acceptance_rate, delta.mean_accepted_length) == (0.75, 3.75)
    llama = parse_samples(
        "# TYPE llamacpp:spec_decode_num_draft_tokens_total counter\n"
        "llamacpp:spec_decode_num_draft_tokens_total 64\n"
        "# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter\n"
        "llamacpp:spec_decode_num_accepted_tokens_total 16\n"
        "# TYPE llamacpp:spec_decode_num_drafts_total counter\n"
        "llamacpp:spec_decode_num_drafts_total 4\n"
    )
    assert speculation_delta({}, llama) == SpeculationDelta(4.0, 64.0, 16.0)
    nothing = speculation_delta({}, dict.fromkeys(vllm, 0.0))
    assert nothing is not None and nothing.acceptance_rate is None and nothing.mean_accepted_length is None
    assert speculation_delta(None, vllm) is None and speculation_delta({}, {"other": 1.0}) is None


def _result(turn: int, **fields: Any) -> RequestResult:
    return RequestResult("t", "c0", 0, turn, 0.0, **fields)


def test_the_report_reads_tpot_per_token_and_acceptance_from_counters_or_timings() -> None:
    workload = workloads.repeat(RepeatSpec(conversations=1))
    # 11 tokens after the first in 0.5 s: 50 ms a token, whatever the chunks were.
    first = _result(1, ttft_s=0.1, e2e_s=0.6, completion_tokens=11, itl_s=[0.25, 0.25])
    second = _result(2, ttft_s=0.1, e2e_s=0.3, completion_tokens=11, itl_s=[0.2])
    counted = TargetRun(Target("kvserve", "http://h"), [first, second], busy_s=1.0)
    counted.speculation = SpeculationDelta(5.0, 20.0, 15.0)
    summary = summarize(counted)
    assert summary.tpot_s.p50 == pytest.approx(0.035)
    assert figure_value(workload, summary) == pytest.approx(0.02)
    assert (summary.speculation_source, summary.acceptance_rate, summary.mean_accepted_length) == (
        "/metrics",
        0.75,
        3.0,
    )
    assert acceptance_cell(summary) == "75.0% (15 / 20)" and accepted_length_cell(summary) == "3.00"
    # llama-server without --metrics: its requests' timings, which count no drafts.
    llama = summarize(
        TargetRun(
            Target("llama.cpp", "http://h"),
            [_result(1, draft_tokens=64, accepted_tokens=16), _result(2, draft_tokens=32, accepted_tokens=8)],
        )
    )
    assert (llama.speculation_source, llama.acceptance_rate, llama.mean_accepted_length) == (
        "timings",
        0.25,
        None,
    )
    assert acceptance_cell(llama) == "25.0% (24 / 96)" and accepted_length_cell(llama) == "n/a"
    silent = summarize(TargetRun(Target("peer", "http://h"), [_result(1)]))
    assert silent.speculation_source is None and acceptance_cell(silent) == "n/a"
    off = TargetRun(Target("off", "http://h"), [_result(1)])
    off.speculation = SpeculationDelta(0.0, 0.0, 0.0)
    assert acceptance_cell(summarize(off)) == "none drafted"
    text = markdown(workload, [summary, llama, silent], [])
    assert "| TPOT p50, turn 2 (ms) | 20.0 |" in text
    assert "| draft tokens accepted | 75.0% (15 / 20) | 25.0% (24 / 96) | n/a |" in text


# ---------------------------------------------------------------------------------------------------------
# Against real kvserve servers, speculation on (the default) and off


def _steady_clock() -> Callable[[], float]:
    """A clock that advances 10 ms a reading: every timed step costs the same whatever its rows, so the
    drafter finds that drafting pays however loaded the machine is (its real clock would make the
    acceptance tests depend on other jobs' load)."""
    ticks = itertools.count()
    return lambda: next(ticks) * 0.01


@pytest.fixture(scope="module")
def servers(
    default_model: LoadedModel, serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[dict[str, str]]:
    """Two real servers on loopback sharing the default model: speculation as by default (its steps
    timed by a steady clock), and off."""
    with ExitStack() as stack:
        urls = {}
        kinds: dict[str, dict[str, Any]] = {"spec": {}, "off": {"speculative": "off"}}
        for name, overrides in kinds.items():
            config = EngineConfig(kv_cache_memory=128 * 2**20, **overrides)
            engine = Engine.from_config(config, model=default_model, clock=_steady_clock())
            urls[name] = stack.enter_context(serve_app(create_app(AsyncEngine(engine), ServerOptions())))
        yield urls


def _report(path: Path) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(path.read_text())
    for target in report["targets"]:
        assert target["errors"] == 0, target["first_error"]
    return report


def _check_speculation(report: dict[str, Any]) -> None:
    """Counters from /metrics; they move only with speculation on, and stay consistent."""
    by_name = {t["name"]: t for t in report["targets"]}
    spec = by_name["spec"]
    assert spec["speculation_source"] == "/metrics"
    if "off" in by_name:
        off = by_name["off"]
        assert off["speculation_source"] == "/metrics"
        assert (off["spec_drafts"], off["spec_draft_tokens"], off["spec_accepted_tokens"]) == (0, 0, 0)
        assert off["acceptance_rate"] is None and off["mean_accepted_length"] is None
    assert spec["spec_accepted_tokens"] <= spec["spec_draft_tokens"]
    assert spec["spec_drafts"] <= spec["spec_draft_tokens"]
    if spec["spec_draft_tokens"]:
        assert spec["acceptance_rate"] == spec["spec_accepted_tokens"] / spec["spec_draft_tokens"]


def test_repeat_sends_turn_1s_reply_back_and_reports_turn_2s_tpot(
    servers: dict[str, str], tmp_path: Path
) -> None:
    rc = bench(
        "repeat",
        *targets(servers, "spec", "off"),
        *("--conversations", "1", "--reply-tokens", "16", "--out", str(tmp_path)),
    )
    assert rc == 0
    report = _report(tmp_path / "repeat.json")
    assert report["settings"]["ignore_eos"] is False
    tokenize = load_default_tokenizer().encode
    for name in ("spec", "off"):
        mine = [r for r in report["requests"] if r["target"] == name]
        first, second = sorted(mine, key=lambda r: r["turn"])
        # Turn 2's prompt is turn 1's prompt, its reply and the new question: the history went back.
        assert first["reply"] and second["reply"]
        assert second["prompt_tokens"] > first["prompt_tokens"] + first["completion_tokens"]
        for r in (first, second):
            assert r["greedy_loop"] is (loop_span(tokenize(r["reply"])) is not None)
        summary = next(t for t in report["targets"] if t["name"] == name)
        (turn_2,) = [t for t in summary["per_turn"] if t["turn"] == 2]
        assert turn_2["tpot_p50_s"] > 0 and summary["loops_checked"] == 2
    _check_speculation(report)
    text = (tmp_path / "repeat.md").read_text()
    assert "| TPOT p50, turn 2 (ms) |" in text and "| draft tokens accepted |" in text
    assert "none drafted" in text and "TPOT p50, turn 2: spec is" in text


def test_code_edit_and_agent_loop_run_and_report_acceptance(servers: dict[str, str], tmp_path: Path) -> None:
    for workload, flags, requests in (
        ("code-edit", ["--conversations", "1"], 1),
        ("agent-loop", ["--conversations", "1", "--turns", "2"], 2),
    ):
        # One target: their prompts are long (1,300 and 1,400 tokens), and the repeat test covers "off".
        rc = bench(
            workload, *targets(servers, "spec"), *flags, *("--reply-tokens", "8", "--out", str(tmp_path))
        )
        assert rc == 0
        report = _report(tmp_path / f"{workload}.json")
        assert len(report["requests"]) == requests
        assert all(r["completion_tokens"] >= 1 and r["reply"] for r in report["requests"])
        _check_speculation(report)
    code_prompt = next(r["prompt_tokens"] for r in _report(tmp_path / "code-edit.json")["requests"])
    assert code_prompt > 1000
    agent = sorted(
        (r for r in _report(tmp_path / "agent-loop.json")["requests"] if r["target"] == "spec"),
        key=lambda r: r["turn"],
    )
    assert agent[0]["prompt_tokens"] > 500 and agent[1]["cached_tokens"] >= agent[0]["prompt_tokens"] - 16


def test_a_repeated_answer_is_drafted_and_accepted(servers: dict[str, str], tmp_path: Path) -> None:
    rc = bench(
        "repeat",
        *targets(servers, "spec"),
        *("--conversations", "1", "--reply-tokens", "48", "--out", str(tmp_path)),
    )
    assert rc == 0
    (spec,) = _report(tmp_path / "repeat.json")["targets"]
    assert spec["spec_accepted_tokens"] > 0 and spec["mean_accepted_length"] > 0


def test_the_dashboard_and_metrics_agree_on_speculation(servers: dict[str, str]) -> None:
    for name, method in (("spec", "suffix"), ("off", "off")):
        speculation = httpx.get(f"{servers[name]}/v1/cache/stats", timeout=30).json()["speculation"]
        samples = parse_samples(httpx.get(f"{servers[name]}/metrics", timeout=30).text)
        assert speculation["method"] == method
        assert speculation["drafts"] == samples["vllm:spec_decode_num_drafts"]
        assert speculation["draft_tokens"] == samples["vllm:spec_decode_num_draft_tokens"]
        assert speculation["accepted_tokens"] == samples["vllm:spec_decode_num_accepted_tokens"]
