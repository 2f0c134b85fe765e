"""Loading models: clear errors for missing, unknown and corrupt files; a GGUF is read in place, and
only its tokenizer is written to the cache."""

import hashlib
import json
import os
import time
from typing import Any

import pytest

from kvserve.cli import main
from kvserve.errors import ModelLoadError
from kvserve.model.fingerprint import file_digest
from kvserve.model.gguf_weights import GgufWeights
from kvserve.model.loader import default_model_path, load_model, tokenizer_dir
from tests.helpers import save_tiny_model


def test_missing_path_names_the_file(tmp_path: Any) -> None:
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError, match="no such file") as e:
        load_model(missing, str(tmp_path))
    assert e.value.path == missing


def test_folder_without_config_or_weights(tmp_path: Any) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json is missing"):
        load_model(str(tmp_path), str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(str(tmp_path), str(tmp_path))


def test_unknown_architecture_is_named(tmp_path: Any) -> None:
    path = save_tiny_model(str(tmp_path / "m"), "llama")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"unsupported architecture.*GPT2LMHeadModel"):
        load_model(path, str(tmp_path))


def test_corrupt_and_pickled_weights_are_refused(tmp_path: Any) -> None:
    path = save_tiny_model(str(tmp_path / "m"), "llama")
    weights = os.path.join(path, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ModelLoadError, match="corrupt") as e:
        load_model(path, str(tmp_path))
    assert e.value.path == weights
    os.remove(weights)
    (tmp_path / "m" / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(ModelLoadError, match="pickled"):
        load_model(path, str(tmp_path))


def test_corrupt_gguf_and_other_files(tmp_path: Any) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(200))
    with pytest.raises(ModelLoadError, match="GGUF") as e:
        load_model(str(bad), str(tmp_path / "cache"))
    assert e.value.path == str(bad)
    other = tmp_path / "weights.pt"
    other.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"\.gguf file or a folder"):
        load_model(str(other), str(tmp_path / "cache"))


def _files(folder: str) -> dict[str, int]:
    return {
        os.path.relpath(os.path.join(root, name), folder): os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(folder)
        for name in names
    }


def test_the_default_gguf_is_read_in_place_and_only_its_tokenizer_is_cached(tmp_path: Any) -> None:
    cache = str(tmp_path / "cache")
    model = load_model(None, cache)
    assert model.path == default_model_path() and model.config.num_layers == 30
    written = _files(cache)
    assert written and all(name.startswith("tokenizers" + os.sep) for name in written)
    assert not any(name.endswith((".safetensors", ".gguf", ".bin")) for name in written)
    assert sum(written.values()) < 8 * 2**20
    assert tokenizer_dir(None, cache) == os.path.dirname(os.path.join(cache, next(iter(written))))
    # Blocks and norms are the mapped file's bytes; q and k are copies, in Hugging Face's row order.
    weights = model.weights
    assert isinstance(weights, GgufWeights)
    file = weights.file

    def mapped(name: str) -> int:
        return int(file.array(file.tensors[name]).ctypes.data)

    assert model.quantized["model.layers.3.mlp.down_proj.weight"].data.data_ptr() == mapped(
        "blk.3.ffn_down.weight"
    )
    assert weights["model.layers.3.input_layernorm.weight"].data_ptr() == mapped("blk.3.attn_norm.weight")
    assert model.quantized["model.layers.3.self_attn.q_proj.weight"].data.data_ptr() != mapped(
        "blk.3.attn_q.weight"
    )
    # A second start reads the same tokenizer folder and writes nothing.
    load_model(None, cache)
    assert _files(cache) == written


def test_cli_reports_a_bad_model_in_one_line(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--log-level", "ERROR", "generate", "--model", str(tmp_path / "missing"), "hi"]) == 2
    err = capsys.readouterr().err
    assert "cannot load model" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hidden_act", "gelu", "hidden_act 'gelu' is not supported"),
        ("rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, "rope scaling 'dynamic' is not supported"),
        ("final_logit_softcapping", 30.0, "final_logit_softcapping is not supported"),
        # A context no rope table could be sized by.
        ("max_position_embeddings", 2**40, "max_position_embeddings 1099511627776 is not a context kvserve"),
        ("max_position_embeddings", 0, "max_position_embeddings 0 is not a context kvserve serves"),
    ],
)
def test_config_fields_that_change_the_math_are_refused(
    tmp_path: Any, field: str, value: Any, message: str
) -> None:
    """Regression: a model whose math we do not implement must not load."""
    path = save_tiny_model(str(tmp_path / "m"), "llama")
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        raw = json.load(f)
    raw[field] = value
    with open(config_path, "w") as f:
        json.dump(raw, f)
    with pytest.raises(ModelLoadError, match=message):
        load_model(path, str(tmp_path))


def test_a_gguf_digest_is_recorded_until_the_file_changes(tmp_path: Any) -> None:
    """The fingerprint hashes a GGUF's bytes, recorded under the file's identity: a changed file (same
    size, its modification time set back) is hashed again, because its change time moved."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    cache = str(tmp_path / "cache")
    first = file_digest(str(path), cache)
    assert first == hashlib.blake2b(path.read_bytes(), digest_size=32).digest()
    records = os.listdir(os.path.join(cache, "fingerprints"))
    assert len(records) == 1
    # A later start reads the record (a record that says otherwise is believed while the file is unchanged).
    with open(os.path.join(cache, "fingerprints", records[0]), "w") as f:
        f.write("ab" * 32)
    assert file_digest(str(path), cache) == bytes.fromhex("ab" * 32)
    before = os.stat(path)
    time.sleep(0.01)
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == before.st_mtime_ns and os.stat(path).st_size == before.st_size
    assert file_digest(str(path), cache) == hashlib.blake2b(bytes(data), digest_size=32).digest()
