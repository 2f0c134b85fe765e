"""The two agents `make agents` runs, Claude Code and Codex CLI: their pinned npm packages, the install
into a local folder, and the settings that point each at kvserve and keep it offline.

Each runs unchanged, with its own default model ids (kvserve serves them as aliases) and only the
settings a user would give it: for Claude Code, environment variables; for Codex, a provider block in
a config.toml of its own. Both also get the recording proxy as their HTTP(S) proxy, so that anything they
would send elsewhere is refused and shown (agent_proxy.py).
"""

import json
import os
import subprocess
from dataclasses import dataclass

CLAUDE_CODE_PACKAGE = "@anthropic-ai/claude-code"
CLAUDE_CODE_VERSION = "2.1.332"
CODEX_PACKAGE = "@openai/codex"
CODEX_VERSION = "0.169.1"

# What each version sends as `model` when it is not told one (as recorded): kvserve serves these names
# as aliases.
CLAUDE_CODE_MODELS = ("claude-opus-5-5",)
CODEX_MODELS = ("gpt-6.2-sol",)

# Claude Code's switches for everything but the model's API (each as its documentation names it).
CLAUDE_CODE_OFFLINE = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_BUG_COMMAND": "1",
    "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
    "DISABLE_INSTALLATION_CHECKS": "1",
    "CLAUDE_CODE_IDE_SKIP_AUTO_INSTALL": "1",
    "CLAUDE_CODE_DISABLE_OFFICIAL_MARKETPLACE_AUTOINSTALL": "1",
}


@dataclass(frozen=True)
class Agent:
    """One CLI run against kvserve: its name in reports, its command and environment, a file of its
    own settings to write first (Codex's config.toml) and its home folder."""

    name: str
    command: list[str]
    env: dict[str, str]
    home: str
    config_file: str | None = None
    config_text: str = ""

    def run(self, workspace: str, timeout_s: float, log_path: str) -> int | None:
        """Run it in `workspace`; its output goes to `log_path`. Returns its exit status, None when it
        ran past `timeout_s` (then it is killed)."""
        os.makedirs(self.home, exist_ok=True)
        if self.config_file is not None:
            os.makedirs(os.path.dirname(self.config_file), exist_ok=True)
            with open(self.config_file, "w") as f:
                f.write(self.config_text)
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                self.command, cwd=workspace, env=self.env, stdin=subprocess.DEVNULL, stdout=log, stderr=log
            )
            try:
                return process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                return None


def install(folder: str) -> str:
    """The pinned packages in `folder`/node_modules, installed with npm unless they already are;
    returns the folder of their commands."""
    wanted = {CLAUDE_CODE_PACKAGE: CLAUDE_CODE_VERSION, CODEX_PACKAGE: CODEX_VERSION}
    if any(_installed_version(folder, name) != version for name, version in wanted.items()):
        os.makedirs(folder, exist_ok=True)
        specs = [f"{name}@{version}" for name, version in wanted.items()]
        npm = ["npm", "install", "--prefix", folder, "--no-save", "--no-audit", "--no-fund", *specs]
        subprocess.run(npm, check=True)
    bin_dir = os.path.join(folder, "node_modules", ".bin")
    for command in ("claude", "codex"):
        # Claude Code's package copies its native binary in place on install; a failed copy shows here.
        subprocess.run([os.path.join(bin_dir, command), "--version"], check=True, capture_output=True)
    return bin_dir


def _installed_version(folder: str, package: str) -> str | None:
    path = os.path.join(folder, "node_modules", *package.split("/"), "package.json")
    try:
        with open(path) as f:
            version: str = json.load(f)["version"]
            return version
    except (OSError, ValueError, KeyError):
        return None


def _base_env(home: str, proxy_url: str) -> dict[str, str]:
    """A clean environment: nothing of the caller's (keys, proxies, other endpoints) reaches a CLI."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": home,
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "HTTP_PROXY": proxy_url,
        "HTTPS_PROXY": proxy_url,
        "http_proxy": proxy_url,
        "https_proxy": proxy_url,
        "NO_PROXY": "127.0.0.1,localhost",
        "no_proxy": "127.0.0.1,localhost",
    }


def claude_code(bin_dir: str, root: str, base_url: str, api_key: str, proxy_url: str, task: str) -> Agent:
    """`claude -p TASK` with its API at `base_url` (kvserve's root: it appends /v1/messages)."""
    home = os.path.join(root, "home")
    env = {
        **_base_env(home, proxy_url),
        "CLAUDE_CONFIG_DIR": os.path.join(home, ".claude"),
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": api_key,
        **CLAUDE_CODE_OFFLINE,
    }
    return Agent("claude-code", [os.path.join(bin_dir, "claude"), "-p", task], env, home)


def codex_config(base_url: str) -> str:
    """Codex's config.toml: kvserve as a provider of the Responses API. The rest keeps it offline: no
    update check, no curated-plugin sync (a git fetch from GitHub and a download from ChatGPT's
    backend at every start), no analytics, feedback or OpenTelemetry export."""
    return f"""\
model_provider = "kvserve"
check_for_update_on_startup = false

[model_providers.kvserve]
name = "kvserve"
base_url = "{base_url}/v1"
wire_api = "responses"
env_key = "KVSERVE_API_KEY"

[features]
plugins = false

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
"""


def codex(bin_dir: str, root: str, base_url: str, api_key: str, proxy_url: str, task: str) -> Agent:
    """`codex exec TASK` with a CODEX_HOME of its own whose config.toml names kvserve."""
    home = os.path.join(root, "home")
    codex_home = os.path.join(home, ".codex")
    env = {**_base_env(home, proxy_url), "CODEX_HOME": codex_home, "KVSERVE_API_KEY": api_key}
    command = [os.path.join(bin_dir, "codex"), "exec", "--skip-git-repo-check", task]
    return Agent("codex", command, env, home, os.path.join(codex_home, "config.toml"), codex_config(base_url))
