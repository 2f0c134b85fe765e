"""Claude Code and Codex CLI, unchanged, against kvserve: every request they make, its status and how
much of its prompt was cached.

Installs both CLIs from npm at pinned versions into .agents/node_modules (once), builds a tiny random
Llama with a 65,536-token context and the default model's tokenizer and chat template (the default
model's 8,192 tokens are too few for the agents' first prompts), starts `kvserve serve` on it on a
loopback port, with the model ids the CLIs send by default as aliases, and runs one non-interactive task
with each CLI twice in the same folder (a fixed path: the CLIs put it in the prompt), so that the
second run's first request can find the first's prefix in the cache (`--only NAME`: one CLI). The
CLIs reach kvserve through a recording proxy (agent_proxy.py); each request's prompt and cached
tokens come from kvserve's own log line for it.

Exits 1 if any request was not answered 2xx, or if a CLI's second run's first request had under 90% of
its prompt cached. Everything is written to .agents/runs/latest/: the report, every request with its
headers and body (credentials blanked), each CLI's output and kvserve's log. `--fixtures` also writes
each CLI's first request to tests/server/agent_requests/, for the API tests to replay.

The model replies with random tokens: it is sampled (the agents send no temperature, so 1.0), and its
end-of-sequence token is given a fixed share of each step's probability so that a reply ends after a few
dozen tokens rather than at the agents' large max_tokens. Run: `make agents`. Never part of `make test`.
"""

import argparse
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from benchmarks.agent_clients import CLAUDE_CODE_MODELS, CODEX_MODELS, Agent, claude_code, codex, install
from benchmarks.agent_proxy import REDACTED, Exchange, RecordingProxy, running_proxy
from kvserve.config import default_cache_dir
from kvserve.model.loader import load_model_tokenizer, tokenizer_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDER = os.path.join(ROOT, ".agents")
FIXTURES = os.path.join(ROOT, "tests", "server", "agent_requests")
CONTEXT = 65536
SERVED_NAME = "kvserve-agents"
TASK = "Read notes.txt in this folder and reply with its first line, nothing else."
NOTES = "kvserve keeps the KV of every prefix it has seen.\nAgents resend their whole context every step.\n"
MIN_CACHED_FRACTION = 0.9
CLIENTS = (("claude-code", claude_code), ("codex", codex))
# The task's folder: one fixed path, so that a run's prompt (which names it) is the same every time.
WORKSPACE = os.path.join(tempfile.gettempdir(), "kvserve-agents-workspace")
RUNS = 2
# The reply's expected length in tokens, sampled at temperature 1 (see the module's docstring).
MEAN_REPLY_TOKENS = 24
# kvserve's line for a finished request (server/openai/serving.py); a request may write several (n, batches).
_LOG_LINE = re.compile(r"kvserve\.server: (\S+): prompt (\d+) tokens \((\d+) cached\)")


@dataclass
class Row:
    """One request in the report."""

    run: str
    method: str
    target: str
    status: int
    prompt_tokens: int | None
    cached_tokens: int | None

    @property
    def cached_fraction(self) -> float | None:
        if not self.prompt_tokens or self.cached_tokens is None:
            return None
        return self.cached_tokens / self.prompt_tokens


def build_model(folder: str) -> str:
    """A 2-layer random Llama with a CONTEXT-token context and the default model's tokenizer and chat
    template, saved once; returns its folder."""
    import transformers

    path = os.path.join(folder, f"model-llama-{CONTEXT}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    default_dir = tokenizer_dir(None, default_cache_dir())
    tokenizer = load_model_tokenizer(None, default_cache_dir())
    vocab, eos = tokenizer.vocab_size, tokenizer.eos_token_ids[0]
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        bos_token_id=tokenizer.backend.token_to_id(str(tokenizer.specials.special_tokens_map["bos_token"])),
        eos_token_id=eos,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    _end_replies_early(model, eos, vocab)
    staging = tempfile.mkdtemp(dir=folder)
    model.save_pretrained(staging, safe_serialization=True)
    for name in os.listdir(default_dir):
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(os.path.join(default_dir, name), staging)
    os.replace(staging, path)
    return path


def _end_replies_early(model: Any, eos: int, vocab: int) -> None:
    """Give the end-of-sequence token a logit that makes it 1 in MEAN_REPLY_TOKENS of each step's
    probability at temperature 1. Hidden dimension 0 carries a constant: 1.0 in every token's
    embedding, and no layer writes to it; the final norm then makes it about sqrt(hidden) whatever the
    token (the other dimensions are the init's 0.02), and only the end token's output row reads it."""
    hidden = model.config.hidden_size
    target = float(torch.log(torch.tensor((vocab - 1) / (MEAN_REPLY_TOKENS - 1))))
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[eos, 0] = target / hidden**0.5


@contextmanager
def kvserve(model: str, port: int, api_key: str, log_path: str) -> Iterator[str]:
    """`kvserve serve` on the model, with the agents' model ids as aliases; yields its URL."""
    names = [SERVED_NAME, *CLAUDE_CODE_MODELS, *CODEX_MODELS]
    argv = [sys.executable, "-m", "kvserve", "serve", "--model", model, "--port", str(port)]
    argv += ["--kv-cache-memory", "256MiB", "--served-model-name", *names]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        env = {**os.environ, "KVSERVE_API_KEY": api_key, "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 300
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"kvserve stopped at startup; see {log_path}")
                try:
                    if httpx.get(f"{url}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kvserve did not start; see {log_path}")
                time.sleep(0.2)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def token_counts(log_text: str) -> dict[str, tuple[int, int]]:
    """(prompt tokens, cached tokens) by request id, from kvserve's log; a request's lines add up."""
    counts: dict[str, tuple[int, int]] = {}
    for request_id, prompt, cached in _LOG_LINE.findall(log_text):
        before = counts.get(request_id, (0, 0))
        counts[request_id] = (before[0] + int(prompt), before[1] + int(cached))
    return counts


def rows(exchanges: list[Exchange], counts: dict[str, tuple[int, int]]) -> list[Row]:
    out = []
    for e in exchanges:
        prompt, cached = counts.get(e.request_id or "", (None, None))
        out.append(Row(e.label, e.method, e.target, e.status, prompt, cached))
    return out


def failures(report: list[Row], agents: list[str]) -> list[str]:
    """Why the run fails: each request not answered 2xx, and each agent whose second run's first
    request was under MIN_CACHED_FRACTION cached (or never made)."""
    problems = [
        f"{r.run} {r.method} {r.target}: HTTP {r.status}" for r in report if not 200 <= r.status < 300
    ]
    for agent in agents:
        label = f"{agent}#{RUNS}"
        first = next((r for r in report if r.run == label), None)
        if first is None:
            problems.append(f"{label} made no request")
            continue
        fraction = first.cached_fraction
        if fraction is None or fraction < MIN_CACHED_FRACTION:
            shown = "no token count" if fraction is None else f"{fraction:.1%} cached"
            problems.append(
                f"{label}'s first request ({first.target}): {shown}, under {MIN_CACHED_FRACTION:.0%}"
            )
    return problems


def table(report: list[Row]) -> str:
    lines = [
        "| run | method | path | status | prompt tokens | cached tokens | cached |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for r in report:
        fraction = r.cached_fraction
        lines.append(
            f"| {r.run} | {r.method} | `{r.target}` | {r.status} | {_count(r.prompt_tokens)} | "
            f"{_count(r.cached_tokens)} | {'-' if fraction is None else f'{fraction:.1%}'} |"
        )
    return "\n".join(lines) + "\n"


def _count(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def recorded(e: Exchange) -> dict[str, Any]:
    """A request as the fixtures hold it: no credential, no machine's user id."""
    body = e.body
    if isinstance(body, dict) and isinstance(body.get("metadata"), dict) and "user_id" in body["metadata"]:
        body = {**body, "metadata": {**body["metadata"], "user_id": REDACTED}}
    return {"method": e.method, "path": e.target, "headers": e.headers, "body": body}


def run_agents(agents: list[Agent], proxy: RecordingProxy, workspace: str, out: str) -> None:
    """Each agent RUNS times in `workspace`, one after the other; the proxy labels their requests."""
    for agent in agents:
        for run in range(1, RUNS + 1):
            label = f"{agent.name}#{run}"
            proxy.label = label
            started = time.monotonic()
            status = agent.run(workspace, 600, os.path.join(out, f"{agent.name}-{run}.log"))
            shown = "timed out" if status is None else f"exit {status}"
            print(f"{label}: {shown} after {time.monotonic() - started:.0f}s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--port", type=int, default=8197, help="kvserve's loopback port (default %(default)s)"
    )
    parser.add_argument("--fixtures", action="store_true", help="write each CLI's first request to the tests")
    parser.add_argument(
        "--only",
        choices=[name for name, _ in CLIENTS],
        help="run this CLI alone (default: each in turn)",
    )
    args = parser.parse_args()

    bin_dir = install(FOLDER)
    model = build_model(FOLDER)
    out = os.path.join(FOLDER, "runs", "latest")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    # Outside the repository (the agents put the git status of their folder's repository in the
    # prompt), and the same path at every run: the agents put it in the prompt too.
    workspace = WORKSPACE
    shutil.rmtree(workspace, ignore_errors=True)
    os.makedirs(workspace, mode=0o700)
    with open(os.path.join(workspace, "notes.txt"), "w") as f:
        f.write(NOTES)
    api_key = secrets.token_hex(16)
    log_path = os.path.join(out, "kvserve.log")

    with kvserve(model, args.port, api_key, log_path) as url, running_proxy(url) as (proxy, proxy_url):
        agents = [
            make(bin_dir, os.path.join(out, name), proxy_url, api_key, proxy_url, TASK)
            for name, make in CLIENTS
            if args.only in (None, name)
        ]
        try:
            run_agents(agents, proxy, workspace, out)
        finally:
            shutil.rmtree(workspace, ignore_errors=True)
    exchanges = list(proxy.exchanges)

    with open(log_path) as f:
        report = rows(exchanges, token_counts(f.read()))
    with open(os.path.join(out, "requests.json"), "w") as f:
        json.dump([{"run": e.label, "status": e.status, **recorded(e)} for e in exchanges], f, indent=1)
    text = table(report)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    print(text)
    names = [a.name for a in agents]
    if args.fixtures:
        write_fixtures(exchanges, names)
    problems = failures(report, names)
    for problem in problems:
        print(f"FAIL: {problem}")
    return 1 if problems else 0


def write_fixtures(exchanges: list[Exchange], names: list[str]) -> None:
    """Each CLI's first request to kvserve, as FIXTURES/<name>.json."""
    os.makedirs(FIXTURES, exist_ok=True)
    for name in names:
        first = next((e for e in exchanges if e.label == f"{name}#1" and not e.external), None)
        if first is None:
            continue
        with open(os.path.join(FIXTURES, f"{name.replace('-', '_')}.json"), "w") as f:
            json.dump(recorded(first), f, indent=1, ensure_ascii=False)
            f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
