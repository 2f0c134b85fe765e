"""What `kvserve serve` keeps resident for its lifetime: the modules it imports. A serving process that
builds its engine on a GGUF whose tokenizer file is built, renders a chat and compiles a grammar never
imports the bench's plotting library nor transformers (nor its model-config stack: torch.distributed's
tensor modules, sympy), and the tokenizer a folder loads without that stack is the one transformers'
AutoTokenizer gives."""

import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from kvserve.cli import build_parser, named_command
from kvserve.config import default_cache_dir
from kvserve.model.loader import _hf_tokenizer, load_default_tokenizer, tokenizer_dir

# Imported by nothing that serves: about 30 MiB (the plotting library), 60 MiB (the config stack), and
# transformers itself (a second and a half of every start).
UNUSED_AT_SERVING = (
    "matplotlib",
    "sympy",
    "transformers",
    "gguf",
    "torch.distributed.tensor",
    "llguidance.hf",
)

_SERVE = """
import sys
from kvserve.cli import build_parser, engine_config, named_command
from kvserve.engine.factory import build_parts
from kvserve.engine.grammar import StructuredOutputs
import kvserve.server.app

argv = ["serve", "--kv-cache-memory", "16MiB", "--threads", "1"]
parts = build_parts(engine_config(build_parser(named_command(argv)).parse_args(argv)))
parts.model.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
parts.grammars.compile(StructuredOutputs(regex="[0-9]+"))
top = {"matplotlib", "sympy", "transformers", "gguf"}
print(" ".join(m for m in sys.modules if m.split(".")[0] in top or m in {U}))
"""


def test_serving_imports_neither_the_plots_nor_transformers() -> None:
    load_default_tokenizer()  # the tokenizer file is built (with transformers) once, before serving
    code = _SERVE.replace("{U}", repr(set(UNUSED_AT_SERVING)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == []


def test_the_bench_command_still_parses() -> None:
    argv = ["--log-level", "DEBUG", "bench", "multiturn", "--target", "http://127.0.0.1:1"]
    assert named_command(argv) == "bench"
    assert build_parser(named_command(argv)).parse_args(argv).command == "bench"


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["serve", "--port", "1"], "serve"),
        (["--log-level", "DEBUG", "chat"], "chat"),
        (["--log-level=DEBUG", "generate", "hi"], "generate"),
        (["--help"], None),
        ([], None),
    ],
)
def test_the_command_is_argvs_first_word_after_the_top_level_option(
    argv: list[str], command: str | None
) -> None:
    assert named_command(argv) == command


def test_the_default_models_tokenizer_is_the_one_autotokenizer_loads() -> None:
    model_dir = tokenizer_dir(None, default_cache_dir())
    ours = _hf_tokenizer(model_dir, "llama")
    auto = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab()
    assert len(ours) == len(auto)
    assert ours.all_special_tokens == auto.all_special_tokens
    assert ours.eos_token_id == auto.eos_token_id
    assert ours.chat_template == auto.chat_template
    assert ours.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
