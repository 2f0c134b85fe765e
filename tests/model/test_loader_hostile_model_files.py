"""Model files are input: every config.json field and GGUF metadata value that changes shapes, memory or
math is range-checked at load, and a bad one is one ModelLoadError of one line, naming the file and the
field, before anything is sized by it. Each case here loaded before (then failed at the first request,
served NaN, or printed a traceback): a non-positive sliding window, a rope base of 0 or NaN, a negative
eps, a YaRN factor of 0, Llama 3 scaling without its low_freq_factor, `num_hidden_layers: true`, counts
far past any model's, an odd head_dim."""

import json
import os
import shutil
import subprocess
import time
from typing import Any

import gguf
import pytest

from kvserve.config import EngineConfig
from kvserve.engine.factory import MAX_ID_BLOCKS, build_parts
from kvserve.errors import ConfigError, ModelLoadError
from kvserve.model import gguf_tokenizer
from kvserve.model.loader import load_model, tokenizer_dir
from kvserve.model.spec import MAX_VOCAB_SIZE
from tests.helpers import save_tiny_model
from tests.model.family_cases import gguf_case
from tests.model.gguf_families import save_tiny_llama, tiny_vocabulary, write_family_gguf

ARCH = "llama"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_llama(str(tmp_path_factory.mktemp("hostile-config") / "llama"))


def refused(path: str, cache: str, message: str) -> ModelLoadError:
    """Loading `path` is one ModelLoadError of one line matching `message`."""
    with pytest.raises(ModelLoadError, match=message) as e:
        load_model(path, cache)
    assert "\n" not in str(e.value)
    return e.value


def _edited(folder: str, tmp_path: Any, edit: dict[str, Any]) -> str:
    path = str(tmp_path / "edited")
    shutil.copytree(folder, path)
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        raw = json.load(f)
    raw.update(edit)
    with open(config_path, "w") as f:
        json.dump(raw, f)
    return path


def _rope(kind: str, **fields: Any) -> dict[str, Any]:
    return {"rope_parameters": {"rope_type": kind, "rope_theta": 10000.0, **fields}}


LLAMA3 = {"factor": 8.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"sliding_window": -4}, "sliding_window must be 1 to 16777216 tokens, not -4"),
        ({"sliding_window": 0}, "sliding_window must be 1 to 16777216 tokens, not 0"),
        ({"sliding_window": 2**40}, "sliding_window must be 1 to 16777216 tokens"),
        ({"max_position_embeddings": 0}, "max_position_embeddings 0 is not a context kvserve serves"),
        (_rope("default", rope_theta=0), "rope_theta must be a finite number above 1, not 0"),
        (_rope("default", rope_theta=-10000.0), "rope_theta must be a finite number above 1, not -10000"),
        (_rope("default", rope_theta=float("nan")), "rope_theta must be a finite number above 1, not nan"),
        ({"rms_norm_eps": -1e-5}, "rms_norm_eps must be a finite number between 0 and 1, not -1e-05"),
        ({"rms_norm_eps": 0}, "rms_norm_eps must be a finite number between 0 and 1, not 0"),
        (_rope("yarn", factor=0), "yarn rope scaling needs factor from 1 to 2\\*\\*16, not 0"),
        (_rope("yarn", factor=4.0, beta_fast=-1), "yarn rope scaling needs beta_fast from 2\\*\\*-16"),
        (
            _rope("linear", factor=float("inf")),
            "linear rope scaling needs factor from 1 to 2\\*\\*16, not inf",
        ),
        (_rope("llama3", **LLAMA3), "llama3 rope scaling needs low_freq_factor from 2\\*\\*-16 .*missing"),
        (
            _rope("llama3", **LLAMA3, low_freq_factor=4.0),
            "llama3 rope scaling needs low_freq_factor 4.0 below high_freq_factor",
        ),
        ({"num_hidden_layers": True}, "num_hidden_layers must be an integer, not True"),
        ({"num_hidden_layers": "2"}, "num_hidden_layers must be an integer, not '2'"),
        ({"num_hidden_layers": 10**9}, "num_hidden_layers must be 1 to 1024, not 1000000000"),
        ({"num_attention_heads": 2**20, "head_dim": 16}, "num_attention_heads 1048576 is more than"),
        ({"num_key_value_heads": 2.5}, "num_key_value_heads must be an integer, not 2.5"),
        ({"vocab_size": 2**30}, "vocab_size 1073741824 is more than kvserve serves"),
        ({"head_dim": 7}, "leaves no even rotary dimension of head_dim 7"),
        (
            {"num_attention_heads": 6, "head_dim": None},
            "hidden_size 64 is not a multiple of num_attention_heads 6, and no head_dim is given",
        ),
        ({"max_position_embeddings": float("inf")}, "max_position_embeddings must be an integer, not inf"),
    ],
)
def test_a_config_field_out_of_range_is_refused_at_load(
    folder: str, tmp_path: Any, edit: dict[str, Any], message: str
) -> None:
    path = _edited(folder, tmp_path, edit)
    error = refused(path, str(tmp_path / "cache"), message)
    assert error.path == os.path.join(path, "config.json")


# ---- The same fields in a GGUF's metadata ------------------------------------------------------------


def _gguf(folder: str, path: str, monkeypatch: pytest.MonkeyPatch, **writers: Any) -> str:
    """The folder's model as a GGUF whose metadata writers `writers` replace (GGUFWriter method name:
    what it writes instead)."""
    with monkeypatch.context() as m:
        for name, writer in writers.items():
            m.setattr(gguf.GGUFWriter, name, writer)
        write_family_gguf(folder, path, ARCH, True)
    return path


@pytest.mark.parametrize(
    ("writers", "message"),
    [
        (
            {"add_rope_freq_base": lambda w, _: w.add_float32("llama.rope.freq_base", 0.0)},
            "rope_theta must be",
        ),
        (
            {"add_rope_freq_base": lambda w, _: w.add_float32("llama.rope.freq_base", float("nan"))},
            "rope_theta must be a finite number above 1, not nan",
        ),
        (
            {
                "add_layer_norm_rms_eps": lambda w, _: w.add_float32(
                    "llama.attention.layer_norm_rms_epsilon", -1
                )
            },
            "rms_norm_eps must be a finite number between 0 and 1, not -1",
        ),
        (
            {"add_head_count": lambda w, _: w.add_bool("llama.attention.head_count", True)},
            "llama.attention.head_count must be an integer, not True",
        ),
        (
            {"add_head_count_kv": lambda w, _: w.add_array("llama.attention.head_count_kv", [2, 2])},
            r"llama.attention.head_count_kv must be an integer, not \[2, 2\]",
        ),
        (
            {"add_head_count": lambda w, _: w.add_uint32("llama.attention.head_count", 3)},
            "not a multiple of num_key_value_heads 2",
        ),
        (
            {
                "add_head_count": lambda w, _: w.add_uint32("llama.attention.head_count", 6),
                "add_head_count_kv": lambda w, _: w.add_uint32("llama.attention.head_count_kv", 3),
            },
            r"tensor blk\.0\.attn_q\.weight is \[64, 64\] but head_count 6",
        ),
        (
            {
                "add_rope_freq_base": lambda w, _: (
                    w.add_float32("llama.rope.freq_base", 10000.0),
                    w.add_string("llama.rope.scaling.type", "linear"),
                    w.add_float32("llama.rope.scaling.factor", 0.0),
                )
            },
            "linear rope scaling needs factor from 1 to 2\\*\\*16, not 0",
        ),
    ],
)
def test_gguf_metadata_out_of_range_is_refused_at_load(
    folder: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, writers: dict[str, Any], message: str
) -> None:
    path = _gguf(folder, str(tmp_path / "bad.gguf"), monkeypatch, **writers)
    assert refused(path, str(tmp_path / "cache"), message).path == path


def _scaling(kind: str, **fields: float) -> dict[str, Any]:
    """The rope scaling keys `kind` and `fields` written with the rope base."""

    def write(w: gguf.GGUFWriter, _: float) -> None:
        w.add_float32("llama.rope.freq_base", 10000.0)
        w.add_string("llama.rope.scaling.type", kind)
        for key, value in fields.items():
            w.add_float32(f"llama.rope.scaling.{key}", value)

    return {"add_rope_freq_base": write}


@pytest.mark.parametrize(
    ("writers", "message"),
    [
        (
            _scaling("yarn", factor=0.0, original_context_length=64),
            "yarn rope scaling needs factor from 1 to",
        ),
        (_scaling("yarn", factor=4.0), "the GGUF metadata lacks llama.rope.scaling.original_context_length"),
        (
            _scaling("yarn", factor=4.0, original_context_length=-64),
            "yarn rope scaling needs original_max_position_embeddings from 1",
        ),
        (
            _scaling("yarn", factor=4.0, original_context_length=64, attn_factor=float("nan")),
            "yarn rope scaling needs attention_factor from 2\\*\\*-16 to 2\\*\\*16, not nan",
        ),
        (_scaling("dynamic", factor=4.0), "llama.rope.scaling.type 'dynamic' is not supported"),
    ],
)
def test_gguf_rope_scaling_out_of_range_is_refused_at_load(
    folder: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, writers: dict[str, Any], message: str
) -> None:
    path = _gguf(folder, str(tmp_path / "bad.gguf"), monkeypatch, **writers)
    assert refused(path, str(tmp_path / "cache"), message).path == path


def test_a_gguf_sliding_window_below_one_token_is_refused(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gemma 3 reads its window from the metadata: -4 loaded before, and the first request's attention
    asserted on it, which stopped the engine."""
    family, overrides = gguf_case("gemma3")
    source = save_tiny_model(str(tmp_path / "gemma3"), family, **overrides)
    path = str(tmp_path / "gemma3.gguf")
    monkeypatch.setattr(
        gguf.GGUFWriter, "add_sliding_window", lambda w, _: w.add_int32("gemma3.attention.sliding_window", -4)
    )
    write_family_gguf(source, path, family, False)
    refused(path, str(tmp_path / "cache"), "sliding_window must be 1 to 16777216 tokens, not -4")


# ---- Tokenizer metadata ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def valid_gguf(folder: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("valid") / "valid.gguf")
    write_family_gguf(folder, path, ARCH, True)
    return path


def _no_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    def build(*_: Any) -> None:
        raise AssertionError("the tokenizer metadata reached transformers' conversion")

    monkeypatch.setattr(gguf_tokenizer, "_build", build)


def test_a_vocabulary_past_the_bound_is_refused_before_any_conversion(
    folder: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2**19 + 1 tokens (the review's file had 2M extra, and its conversion passed 5 GB): refused from the
    array's length, before transformers converts anything."""
    extra = MAX_VOCAB_SIZE + 1 - len(tiny_vocabulary(ARCH))
    add_token_list = gguf.GGUFWriter.add_token_list

    def more_tokens(writer: gguf.GGUFWriter, tokens: list[str]) -> None:
        add_token_list(writer, [*tokens, *(f"x{i}" for i in range(extra))])

    path = _gguf(folder, str(tmp_path / "big.gguf"), monkeypatch, add_token_list=more_tokens)
    _no_conversion(monkeypatch)
    refused(path, str(tmp_path / "cache"), f"vocab_size {MAX_VOCAB_SIZE + 1} is more than kvserve serves")
    with pytest.raises(ModelLoadError, match=f"tokenizer.ggml.tokens holds {MAX_VOCAB_SIZE + 1} entries"):
        tokenizer_dir(path, str(tmp_path / "cache"))


@pytest.mark.parametrize(
    ("bound", "message"),
    [
        ("MAX_MERGES", r"tokenizer\.ggml\.merges holds \d+ entries; kvserve reads at most 4"),
        ("MAX_TOKENIZER_BYTES", r"the tokenizer metadata takes \d+ bytes; kvserve reads at most 4"),
    ],
)
def test_tokenizer_metadata_past_its_bounds_is_refused_before_any_conversion(
    valid_gguf: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, bound: str, message: str
) -> None:
    monkeypatch.setattr(gguf_tokenizer, bound, 4)
    _no_conversion(monkeypatch)
    with pytest.raises(ModelLoadError, match=message):
        tokenizer_dir(valid_gguf, str(tmp_path / "cache"))


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_build_folders_a_killed_process_left_are_swept(valid_gguf: str, tmp_path: Any) -> None:
    """A killed build leaves its folder: the next start removes it once its process is gone (or once it
    is a day old, whoever made it), and leaves a running build's alone."""
    cache = tmp_path / "cache"
    now = time.time()
    folders = {
        f"tokenizers/.building-{_dead_pid()}-dead": (now - 120, False),
        f"tokenizers/.building-{_dead_pid()}-dead-but-new": (now, True),
        f"tokenizers/.building-{os.getpid()}-running": (now - 120, True),
        f"tokenizers/.building-{os.getpid()}-running-for-days": (now - 3 * 86400, False),
        "gguf/.converting-of-an-older-version": (now - 2 * 86400, False),
        "gguf/.converting-new": (now, True),
        "gguf/0123abcd-v1": (now - 2 * 86400, True),
    }
    for name, (mtime, _) in folders.items():
        (cache / name).mkdir(parents=True)
        (cache / name / "tokenizer.json").write_text("{}")
        os.utime(cache / name, (mtime, mtime))
    tokenizer_dir(valid_gguf, str(cache))
    assert {name for name in folders if (cache / name).exists()} == {
        n for n, (_, kept) in folders.items() if kept
    }


# ---- The context length, bounded by memory ----------------------------------------------------------


def test_an_all_sliding_models_context_is_bounded_by_memory(folder: str, tmp_path: Any) -> None:
    """Every layer sliding, the KV pool does not bound the context: a claim of 2**24 tokens built a
    global group of 8.6e9 block ids and rope tables of 1 GiB before (2 GiB resident at 2**16 already).
    Served, it is capped to the rope tables that kv_cache_memory holds (64 bytes a position here), and a
    --max-model-len past that is refused with one line."""
    path = _edited(folder, tmp_path, {"sliding_window": 4, "max_position_embeddings": 2**24})
    memory = 128 * 2**20
    parts = build_parts(EngineConfig(model=path, kv_cache_memory=memory, cache_dir=str(tmp_path / "cache")))
    fits = memory // 64
    assert parts.max_model_len == fits
    assert parts.kv.pool.num_blocks <= max(MAX_ID_BLOCKS, fits // 16)
    assert parts.runner.transformer.rotary.cos.shape[0] <= fits
    with pytest.raises(ConfigError, match=r"max_model_len 3000000 needs .* of rope tables, more than") as e:
        build_parts(EngineConfig(model=path, kv_cache_memory=memory, max_model_len=3_000_000))
    assert "\n" not in str(e.value)
