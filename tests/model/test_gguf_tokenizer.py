"""A GGUF's tokenizer is the one transformers' AutoTokenizer builds from the file, for every family's
architecture (kvserve names the tokenizer class rather than have AutoTokenizer read the file into a
model config to find it)."""

from typing import Any

import gguf
import pytest
from transformers import AutoTokenizer

from kvserve.model.gguf_file import open_gguf
from kvserve.model.gguf_tokenizer import tokenizer_class, tokenizer_dir
from kvserve.model.loader import load_tokenizer
from tests.model.gguf_families import write_tiny_vocabulary


def _tokenizer_gguf(path: str, family: str, architecture: str) -> None:
    writer = gguf.GGUFWriter(path, architecture)
    write_tiny_vocabulary(writer, family)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("family", "architecture"),
    [
        ("llama", "llama"),
        ("qwen2", "qwen2"),
        ("qwen3", "qwen3"),
        ("qwen3", "qwen3moe"),
        ("phi3", "phi3"),
        ("gemma3", "gemma3"),
    ],
)
def test_the_tokenizer_is_autotokenizers(tmp_path: Any, family: str, architecture: str) -> None:
    path = str(tmp_path / "model.gguf")
    _tokenizer_gguf(path, family, architecture)
    ours = tokenizer_class(architecture).from_pretrained(str(tmp_path), gguf_file="model.gguf")
    auto = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="model.gguf")
    assert type(ours) is type(auto)
    assert ours.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    assert ours.all_special_tokens == auto.all_special_tokens
    for special in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(ours, special) == getattr(auto, special)
    text = "Hello world, how are you?"
    assert ours(text)["input_ids"] == auto(text)["input_ids"]
    # The folder kvserve keeps holds that tokenizer and the file's chat template.
    folder = tokenizer_dir(open_gguf(path), architecture, str(tmp_path / "cache"))
    kept = load_tokenizer(folder)
    assert kept.encode(text) == auto(text)["input_ids"]
    assert kept.chat_template == "{% for m in messages %}{{ m['content'] }}{% endfor %}"
