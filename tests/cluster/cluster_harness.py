"""What the cluster tests share: the replicas' model name, a long shared system prompt, a secret file."""

import secrets
from pathlib import Path

MODEL = "SmolLM2-135M-Instruct"


def system_prompt(topic: str) -> str:
    return " ".join(f"Note {i} about {topic}: item {i} weighs {i * 7 % 13} units." for i in range(30))


def secret_file(path: Path) -> str:
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return str(path)
