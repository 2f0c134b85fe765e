"""The derived tokenizer file of a GGUF (model/tokenizer_cache.py): the tokenizer it gives is the one
transformers loads from the tokenizer folder (the same ids, the same text decoded, special tokens and
chat templates included), it is built once, and a file that is truncated, altered, of another key or
holding values of the wrong types is built again, never used."""

import hashlib
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import gguf
import pytest
import tokenizers

from kvserve.config import default_cache_dir
from kvserve.model import tokenizer_cache
from kvserve.model.gguf_file import open_gguf
from kvserve.model.gguf_tokenizer import tokenizer_dir
from kvserve.model.loader import load_default_tokenizer, load_tokenizer
from kvserve.model.loader import tokenizer_dir as model_tokenizer_dir
from kvserve.model.tokenizer import Tokenizer
from kvserve.model.tokenizer_cache import FILE_NAME, cached_tokenizer
from tests.model.gguf_families import write_tiny_vocabulary

CORPUS = [
    "",
    "Hello world, how are you?",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "ünïcödé, 日本語のテキスト, emoji 🙂👍🏽, and a zero-width\u200bjoiner",
    "digits 0123456789 and 3.14159e-10",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<bos><start_of_turn>user\nhi<end_of_turn>\n<eos><pad><unk>",
    "<|endoftext|>glued<|im_end|>text",
    "Hellohow areyou youyou",
]

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello <|im_start|> world"},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "how are you?"},
]

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _tokenizer_gguf(path: str, family: str, architecture: str) -> None:
    writer = gguf.GGUFWriter(path, architecture)
    write_tiny_vocabulary(writer, family)
    writer.add_chat_template(TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_same(ours: Tokenizer, reference: Tokenizer) -> None:
    """`ours` tokenizes, decodes and renders as `reference` does."""
    assert ours.vocab_size == reference.vocab_size
    assert ours.eos_token_ids == reference.eos_token_ids
    assert ours.special_tokens == reference.special_tokens
    assert ours.chat_template == reference.chat_template
    assert ours.max_token_chars() == reference.max_token_chars()
    every_id = list(range(reference.vocab_size))
    for skip in (True, False):
        assert ours.decode(every_id, skip_special_tokens=skip) == reference.decode(every_id, skip)
    for text in CORPUS:
        for special in (True, False):
            ids = reference.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip)
            stream, expected = ours.decode_stream(False), reference.decode_stream(False)
            assert [stream.step(i) for i in ids] == [expected.step(i) for i in ids]
    assert [ours.token_bytes(i) for i in every_id] == [reference.token_bytes(i) for i in every_id]
    for generation in (True, False):
        assert ours.encode_chat(MESSAGES, generation) == reference.encode_chat(MESSAGES, generation)


@pytest.fixture(
    params=[("llama", "llama", "llama"), ("qwen2", "qwen2", "qwen2"), ("gemma3", "gemma3", "gemma3_text")]
)
def folder_and_type(request: pytest.FixtureRequest, tmp_path: Any) -> tuple[str, str]:
    family, architecture, model_type = request.param
    path = str(tmp_path / "model.gguf")
    _tokenizer_gguf(path, family, architecture)
    return tokenizer_dir(open_gguf(path), architecture, str(tmp_path / "cache")), model_type


def _counting(folder: str, model_type: str) -> tuple[Callable[[], Tokenizer], list[int]]:
    builds: list[int] = []

    def build() -> Tokenizer:
        builds.append(1)
        return load_tokenizer(folder, None, model_type)

    return build, builds


def _from_file(folder: str, model_type: str, key: str = "key") -> tuple[Tokenizer, int]:
    """The tokenizer through the derived file, and how many times it was built."""
    build, builds = _counting(folder, model_type)
    return Tokenizer(*cached_tokenizer(folder, key, build)), len(builds)


def test_the_file_gives_the_tokenizer_transformers_loads(folder_and_type: tuple[str, str]) -> None:
    folder, model_type = folder_and_type
    reference = load_tokenizer(folder, None, model_type)
    first, built = _from_file(folder, model_type)
    assert built == 1
    later, built = _from_file(folder, model_type)
    assert built == 0
    assert_same(first, reference)
    assert_same(later, reference)
    assert later.chat_template == TEMPLATE


def test_the_default_models_tokenizer_is_the_folders() -> None:
    """The default model's tokenizer (served from its derived file) is the one transformers loads from
    its tokenizer folder."""
    reference = load_tokenizer(model_tokenizer_dir(None, default_cache_dir()), model_type="llama")
    assert_same(load_default_tokenizer(), reference)
    assert load_default_tokenizer().render_chat(MESSAGES) == reference.render_chat(MESSAGES)


def _rewritten(body: Callable[[bytes, bytes], tuple[bytes, bytes]]) -> Callable[[bytes], bytes]:
    """A damage that rewrites the header and the tokenizer and signs the result with a valid checksum."""

    def damage(data: bytes) -> bytes:
        head, _, serialized = data.partition(b"\n")[2].partition(b"\n")
        head, serialized = body(head, serialized)
        new = head + b"\n" + serialized
        return hashlib.sha256(new).hexdigest().encode() + b"\n" + new

    return damage


def _header(**changes: Any) -> Callable[[bytes], bytes]:
    def change(head: bytes, serialized: bytes) -> tuple[bytes, bytes]:
        fields = json.loads(head)
        for name, value in changes.items():
            if name in fields:
                fields[name] = value
            else:
                fields["specials"][name] = value
        return json.dumps(fields).encode(), serialized

    return _rewritten(change)


DAMAGES: dict[str, Callable[[bytes], bytes]] = {
    "empty": lambda data: b"",
    "truncated": lambda data: data[: len(data) // 2],
    "one byte flipped": lambda data: data[:-10] + bytes([data[-10] ^ 1]) + data[-9:],
    "a token renamed": lambda data: data.replace(b'"ow"', b'"oW"', 1),
    "another key": _header(key="another"),
    "another format": _header(format=0),
    "a header that is not JSON": _rewritten(lambda head, serialized: (b"{not json", serialized)),
    "an eos id out of range": _header(eos_token_id=10**9),
    "a vocabulary size of the wrong type": _header(vocab_size="many"),
    "a vocabulary smaller than the tokenizer": _header(vocab_size=3),
    "a chat template of the wrong type": _header(chat_template=["x"]),
    "special tokens of the wrong type": _header(all_special_tokens=[1, 2]),
    "a tokenizer that does not parse": _rewritten(lambda head, serialized: (head, b'{"model": 1}')),
    "a tokenizer that is not UTF-8": _rewritten(lambda head, serialized: (head, b"\xff\xfe")),
}


CHANGED_BYTES = ("empty", "truncated", "one byte flipped", "a token renamed")


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_file_is_built_again(
    folder_and_type: tuple[str, str], damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    folder, model_type = folder_and_type
    reference = load_tokenizer(folder, None, model_type)
    _from_file(folder, model_type)
    path = os.path.join(folder, FILE_NAME)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(DAMAGES[damage](data))
    with caplog.at_level(logging.WARNING, "kvserve.model"):
        rebuilt, built = _from_file(folder, model_type)
    assert built == 1
    assert "is damaged" in caplog.text
    # Whatever else would catch them, a file's own bytes changed are caught by its checksum first.
    assert ("checksum" in caplog.text) == (damage in CHANGED_BYTES)
    assert_same(rebuilt, reference)
    with open(path, "rb") as f:
        assert f.read() == data
    assert _from_file(folder, model_type)[1] == 0


def test_a_file_past_the_bound_is_built_again(
    folder_and_type: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, model_type = folder_and_type
    _from_file(folder, model_type)
    monkeypatch.setattr(tokenizer_cache, "MAX_FILE_BYTES", 64)
    assert _from_file(folder, model_type)[1] == 1


def test_something_else_in_the_files_place_is_built_around(folder_and_type: tuple[str, str]) -> None:
    """A folder where the file goes: the tokenizer is built and served each time, the folder left alone."""
    folder, model_type = folder_and_type
    os.mkdir(os.path.join(folder, FILE_NAME))
    for _ in range(2):
        served, built = _from_file(folder, model_type)
        assert built == 1
        assert_same(served, load_tokenizer(folder, None, model_type))
    assert os.path.isdir(os.path.join(folder, FILE_NAME))
    assert [n for n in os.listdir(folder) if n.startswith(f".{FILE_NAME}")] == []


def test_another_tokenizers_version_builds_the_file_again(
    folder_and_type: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, model_type = folder_and_type
    _from_file(folder, model_type)
    monkeypatch.setattr(tokenizers, "__version__", "0.0.0-another")
    assert _from_file(folder, model_type)[1] == 1
    assert _from_file(folder, model_type)[1] == 0
