"""bench-peer's speculation comparison without running it: which servers each workload runs on, their
command lines, and the summary's ratios and targets, from reports built by the bench's own code."""

from typing import Any

import pytest
from benchmarks.bench_peer import (
    KVSERVE,
    KVSERVE_SPEC_OFF,
    LLAMA,
    LLAMA_SPEC,
    WORKLOADS,
    kvserve_flag_sets,
    llama_argv,
    servers_needed,
    speculation_summary,
    target_args,
)

from kvserve_bench import workloads
from kvserve_bench.client import RequestResult, Target
from kvserve_bench.metrics_scrape import SpeculationDelta
from kvserve_bench.report import report_data, summarize
from kvserve_bench.runner import TargetRun
from kvserve_bench.workloads import RepeatSpec, Workload


def test_copy_workloads_run_on_kvserve_and_llama_cpp_with_and_without_speculation() -> None:
    for name in ("repeat", "code-edit", "agent-loop"):
        assert WORKLOADS[name].bench[0] == name
        assert set(WORKLOADS[name].targets) == {KVSERVE, KVSERVE_SPEC_OFF, LLAMA_SPEC, LLAMA}
        assert WORKLOADS[name].targets[0] == KVSERVE
    assert WORKLOADS["sharegpt"].targets == (KVSERVE, LLAMA, KVSERVE_SPEC_OFF)
    for name in ("sharegpt-1", "sharegpt-8"):
        assert WORKLOADS[name].targets == (KVSERVE, KVSERVE_SPEC_OFF)
    # Each load replays conversations of its own: a drafter remembers the replies it gave.
    chats = [WORKLOADS[name].bench for name in ("sharegpt-1", "sharegpt", "sharegpt-8")]
    assert [bench[0] for bench in chats] == ["sharegpt"] * 3
    seeds = [bench[bench.index("--seed") + 1] if "--seed" in bench else "0" for bench in chats]
    assert len(set(seeds)) == 3
    assert WORKLOADS["multiturn-1"].targets == (KVSERVE, LLAMA, KVSERVE_SPEC_OFF)
    assert servers_needed(["multiturn-8", "shared-prefix"]) == {KVSERVE, LLAMA}
    assert servers_needed(["sharegpt"]) == {KVSERVE, LLAMA, KVSERVE_SPEC_OFF}
    urls = {KVSERVE: "http://a", LLAMA: "http://b", KVSERVE_SPEC_OFF: "http://c", LLAMA_SPEC: "http://d"}
    assert target_args(WORKLOADS["sharegpt"], urls) == [
        "kvserve=http://a",
        "llama.cpp=http://b",
        "kvserve-spec-off=http://c",
    ]


def test_server_command_lines_differ_only_in_speculation() -> None:
    plain = llama_argv("llama-server", "m.gguf", 8191, speculative=False)
    spec = llama_argv("llama-server", "m.gguf", 8192, speculative=True)
    assert "--spec-default" not in plain and spec[-1] == "--spec-default"
    assert {"--metrics", "--cache-ram"} <= set(plain)
    assert [a for a in spec if a not in ("--spec-default", "8192")] == [a for a in plain if a != "8191"]
    flags = ["--threads", "2", "--kv-cache-memory", "360MiB"]
    assert kvserve_flag_sets(flags, {KVSERVE, LLAMA}) == [flags]
    # Speculation on starts last: its probe runs with no server starting beside it.
    assert kvserve_flag_sets(flags, {KVSERVE, KVSERVE_SPEC_OFF}) == [[*flags, "--speculative", "off"], flags]


def _run(
    name: str, tpots: dict[int, float], tokens_per_s: float, speculation: SpeculationDelta | None
) -> TargetRun:
    """A target's run whose requests took `tpots[turn]` a token after the first, 11 tokens each."""
    results = [
        RequestResult(name, "c0", 0, turn, 0.0, ttft_s=0.1, e2e_s=0.1 + 10 * tpot, completion_tokens=11)
        for turn, tpot in tpots.items()
    ]
    run = TargetRun(Target(name, "http://h", "m"), results, busy_s=11 * len(results) / tokens_per_s)
    run.speculation = speculation
    return run


def _report(workload: Workload, runs: list[TargetRun]) -> dict[str, Any]:
    return report_data(workload, runs, [summarize(run) for run in runs], "test", "now")


def test_the_summary_computes_the_targets_ratios_from_the_reports() -> None:
    repeat = _report(
        workloads.repeat(RepeatSpec(conversations=1)),
        [
            _run(KVSERVE, {1: 0.030, 2: 0.010}, 50.0, SpeculationDelta(10.0, 40.0, 30.0)),
            _run(KVSERVE_SPEC_OFF, {1: 0.030, 2: 0.025}, 40.0, SpeculationDelta(0.0, 0.0, 0.0)),
            _run(LLAMA_SPEC, {1: 0.040, 2: 0.020}, 30.0, SpeculationDelta(4.0, 64.0, 16.0)),
            _run(LLAMA, {1: 0.040, 2: 0.040}, 25.0, None),
        ],
    )
    sharegpt_workload = Workload("sharegpt", "chat", (), 64, 4, {})
    sharegpt = _report(
        sharegpt_workload,
        [
            _run(KVSERVE, {1: 0.02}, 96.0, SpeculationDelta(5.0, 10.0, 2.0)),
            _run(LLAMA, {1: 0.03}, 70.0, None),
            _run(KVSERVE_SPEC_OFF, {1: 0.02}, 100.0, SpeculationDelta(0.0, 0.0, 0.0)),
        ],
    )
    alone = _report(
        Workload("sharegpt", "chat", (), 64, 1, {}),
        [
            _run(KVSERVE, {1: 0.01}, 110.0, SpeculationDelta(5.0, 10.0, 8.0)),
            _run(KVSERVE_SPEC_OFF, {1: 0.01}, 100.0, SpeculationDelta(0.0, 0.0, 0.0)),
        ],
    )
    data, table = speculation_summary({"repeat": repeat, "sharegpt": sharegpt, "sharegpt-1": alone})
    rows = data["workloads"]["repeat"]
    # Turn 2's TPOT is the figure, not the whole run's.
    assert rows[KVSERVE]["tpot_s"] == pytest.approx(0.010) and rows[LLAMA]["tpot_s"] == pytest.approx(0.040)
    assert rows[KVSERVE]["acceptance_rate"] == 0.75 and rows[KVSERVE]["mean_accepted_length"] == 3.0
    assert rows[LLAMA]["acceptance_rate"] is None and rows[LLAMA]["draft_tokens"] is None
    targets = data["targets"]
    spec_vs_off = targets["repeat, turn 2 TPOT, kvserve / kvserve --speculative off"]
    assert spec_vs_off["value"] == pytest.approx(0.4) and spec_vs_off["met"] is True
    vs_llama = targets["repeat, turn 2 TPOT, kvserve / llama.cpp --spec-default"]
    assert vs_llama["value"] == pytest.approx(0.5) and vs_llama["met"] is True
    chat = targets["sharegpt, 4 in flight, output tokens/s, kvserve / kvserve --speculative off"]
    assert chat["value"] == pytest.approx(0.96) and chat["met"] is False
    one = targets["sharegpt, 1 in flight, output tokens/s, kvserve / kvserve --speculative off"]
    assert one["value"] == pytest.approx(1.1) and one["met"] is True
    eight = targets["sharegpt, 8 in flight, output tokens/s, kvserve / kvserve --speculative off"]
    assert eight["value"] is None and eight["met"] is None
    assert "| sharegpt-1 | kvserve | 10.0 | 110.0 | 80.0% |" in table
    assert "| repeat | kvserve | 10.0 | 50.0 | 75.0% | 3.00 | 0 of 0 |" in table
    assert "| repeat | llama.cpp | 40.0 | 25.0 | n/a | n/a | 0 of 0 |" in table
    assert "| repeat | kvserve-spec-off | 25.0 | 40.0 | none drafted | n/a | 0 of 0 |" in table
    assert (
        "sharegpt, 4 in flight, output tokens/s, kvserve / kvserve --speculative off: 0.96x (at least 0.97x: "
        "missed)" in table
    )
    # A run without sharegpt leaves its target unmeasured rather than failed.
    partial, text = speculation_summary({"repeat": repeat})
    label = "sharegpt, 4 in flight, output tokens/s, kvserve / kvserve --speculative off"
    assert partial["targets"][label]["met"] is None
    assert "not measured" in text
