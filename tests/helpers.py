"""Builders for the tests: tiny random Hugging Face models saved as real model folders, servers on
loopback ports, and products driven as decode rows."""

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import torch

from kvserve.config import default_cache_dir
from kvserve.model.loader import tokenizer_dir
from kvserve.model.runner import ForwardBatch, ModelRunner, SequenceChunk

_TINY: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
}


# Each family's transformers config and model class, by our family name.
TINY_CLASSES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
}


def save_tiny_model(path: str, architecture: str, **overrides: Any) -> str:
    """A random model of the given family with the default model's tokenizer files; returns its folder."""
    import transformers

    config_name, model_name = TINY_CLASSES[architecture]
    config_class = getattr(transformers, config_name)
    model_class = getattr(transformers, model_name)
    default_dir = tokenizer_dir(None, default_cache_dir())
    fields = {**_TINY, "vocab_size": 49152, "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0}
    config = config_class(**{**fields, **overrides})
    torch.manual_seed(0)
    model = model_class(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            # Larger than the init's 0.02 so that logits are far from uniform and argmax is stable.
            p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    for name in os.listdir(default_dir):
        if name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(os.path.join(default_dir, name), path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def server_process(argv: list[str], port: int) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Start `argv` (a kvserve server listening on `port`) as a child process, wait until /health answers,
    yield (process, url); kill it at the end if it is still running."""
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.communicate()[0].decode()
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


class Clock:
    """A manager's clock that moves only when a test sets `now`: expiry at exact times, no sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def prefilled_decodes(runner: ModelRunner, lengths: list[int], seed: int) -> list[SequenceChunk]:
    """One decode for each prompt length, its prompt already in the cache (16 blocks per sequence)."""
    gen = torch.Generator().manual_seed(seed)
    decodes = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, 4096, (n,), generator=gen).tolist()
        table = list(range(16 * i, 16 * (i + 1)))
        runner.execute(ForwardBatch(prefills=[SequenceChunk(ids[:-1], 0, table, False)]))
        decodes.append(SequenceChunk(ids[-1:], n - 1, table, True))
    return decodes
