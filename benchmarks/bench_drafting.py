"""The drafter on its own (no model): what indexing and proposing cost, and what its length policy gains
under the step cost model it assumes, on text where the next tokens are known.

- Times (CPU time, best of several runs): ingesting a 30,000-token prompt, a propose per decoding step
  with that prompt (no match; copying it; a loop), a finished 1,000-token reply into a full namespace.
- Policy: the output is known text (this repository's design doc and README, one token per word or
  punctuation mark), a draft is accepted up to its first wrong token, and a step of R rows costs
  T0 + R*c (c/T0 = drafting.ROW_COST): one sequence pays its share of the step plus c per draft row.
  The speed-up is the time per output token without drafts over that with them, for prose that
  continues the prompt and for a passage of the prompt copied with 2% of its tokens changed.

Run: `make bench-drafting` (writes benchmarks/results/drafting.{json,md}; seconds).
"""

import random
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import write_results
from kvserve.engine import drafting
from kvserve.engine.drafting import Drafter

ROOT = Path(__file__).resolve().parent.parent


def cpu_ms(run: Callable[[], float | None], repeats: int = 7) -> float:
    """The least CPU time of `repeats` runs, or the least of what the runs return (their own timing)."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        own = run()
        times.append((time.process_time() - start) if own is None else own)
    return min(times) * 1000


def timings() -> dict[str, float]:
    rng = random.Random(1)
    prompt = [rng.randrange(49152) for _ in range(30_000)]

    def ingest() -> None:
        Drafter(8).propose("r", "ns", prompt, 8, 1)

    def steps(extra: list[int]) -> Callable[[], float]:
        def run() -> float:
            drafter = Drafter(8)
            for i in range(16):
                drafter.finished(f"f{i}", "ns", [rng.randrange(49152) for _ in range(1000)])
            tokens = list(prompt)
            drafter.propose("r", "ns", tokens, 8, 1)
            start = time.process_time()
            for token in extra:
                tokens.append(token)
                drafter.propose("r", "ns", tokens, 8, 1)
            return (time.process_time() - start) / len(extra)

        return run

    def finished() -> float:
        drafter = Drafter(8)
        for i in range(17):
            drafter.finished(f"f{i}", "ns", [rng.randrange(49152) for _ in range(1000)])
        replies = [[rng.randrange(49152) for _ in range(1000)] for _ in range(20)]
        start = time.process_time()
        for i, reply in enumerate(replies):
            drafter.finished(f"g{i}", "ns", reply)
        return (time.process_time() - start) / len(replies)

    return {
        "ingest_30k_ms": cpu_ms(ingest),
        "propose_no_match_us": cpu_ms(steps([rng.randrange(49152) for _ in range(1000)]), 3) * 1000,
        "propose_copying_us": cpu_ms(steps(prompt[100:1100]), 3) * 1000,
        "propose_loop_us": cpu_ms(steps([7, 8, 9] * 333), 3) * 1000,
        "finished_1000_into_full_namespace_ms": cpu_ms(finished, 3),
    }


def speedup(prompt: list[int], output: list[int], load: int, max_tokens: int = 8) -> dict[str, float]:
    drafter = Drafter(max_tokens)
    tokens = list(prompt)
    share = (1 + drafting.ROW_COST * load) / load  # one sequence's share of a step, T0 = 1
    done = drafted = accepted = 0
    cost = 0.0
    while done < len(output):
        draft = drafter.propose("r", "ns", tokens, max_tokens, load)
        right = 0
        while right < len(draft) and done + right < len(output) and draft[right] == output[done + right]:
            right += 1
        if draft:
            drafter.verified("r", len(draft), right)
        drafted += len(draft)
        accepted += right
        step = min(right + 1, len(output) - done)
        tokens.extend(output[done : done + step])
        done += step
        cost += share + drafting.ROW_COST * len(draft)
    return {"speedup": share * len(output) / cost, "drafted": drafted, "accepted": accepted}


def policy() -> dict[str, dict[str, float]]:
    text = (ROOT / "docs" / "design.md").read_text() + (ROOT / "README.md").read_text()
    ids: dict[str, int] = {}
    words = [ids.setdefault(w, len(ids)) for w in re.findall(r"\w+|[^\w\s]", text)]
    rng = random.Random(0)
    passage = words[5000:5600]
    edited = [w if rng.random() > 0.02 else rng.randrange(len(ids)) for w in passage]
    out: dict[str, dict[str, float]] = {}
    for load in (1, 4, 8):
        out[f"prose, load {load}"] = speedup(words[:3000], words[3000:4500], load)
        out[f"prose later on, load {load}"] = speedup(words[20000:30000], words[30000:31500], load)
        out[f"copy with edits, load {load}"] = speedup(words[:6000], edited, load)
    return out


def main() -> None:
    results: dict[str, Any] = {"timings": timings(), "policy": policy()}
    lines = ["| measure | value |", "|---|---|"]
    lines += [f"| {name} | {value:.2f} |" for name, value in results["timings"].items()]
    lines += ["", "| workload | speed-up | drafted | accepted |", "|---|---|---|---|"]
    lines += [
        f"| {name} | {r['speedup']:.3f} | {r['drafted']:.0f} | {r['accepted']:.0f} |"
        for name, r in results["policy"].items()
    ]
    write_results("drafting", results, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
