"""A GGUF is input: every way a file can be bad is one ModelLoadError at load, naming the file (and the
tensor or key where there is one), found before anything is read or allocated by a count the file
gives. Each bad file is made from a tiny valid one (a Llama, q/k interleaved as llama.cpp stores them,
Q8_0 matrices with a Q6_K down projection, F32 norms), by editing its bytes or by writing it with bad
metadata; random byte flips and cuts either load or raise ModelLoadError, never another exception."""

import os
import struct
from collections.abc import Callable
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.errors import ModelLoadError
from kvserve.model.gguf_file import open_gguf
from kvserve.model.loader import load_model
from kvserve.model.runner import ModelRunner
from tests.helpers import save_tiny_model
from tests.model.family_cases import gguf_case
from tests.model.gguf_families import save_tiny_llama, tiny_vocabulary, write_family_gguf

ARCH = "llama"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_llama(str(tmp_path_factory.mktemp("hostile") / "llama"))


def _write(folder: str, path: str, **changes: Any) -> str:
    write_family_gguf(folder, path, ARCH, True, **changes)
    return path


@pytest.fixture(scope="module")
def valid(folder: str, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = _write(folder, str(tmp_path_factory.mktemp("valid") / "valid.gguf"))
    load_model(path, str(tmp_path_factory.mktemp("cache")))
    with open(path, "rb") as f:
        return f.read()


def _refused(tmp_path: Any, data: bytes, message: str) -> ModelLoadError:
    """`data` as a file is refused at load with one ModelLoadError naming it and matching `message`."""
    path = str(tmp_path / "bad.gguf")
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(ModelLoadError, match=message) as e:
        load_model(path, str(tmp_path / "cache"))
    assert e.value.path == path
    return e.value


def _info(data: bytes, name: str) -> int:
    """Where tensor `name`'s dimension count lies (its dims, type and offset follow)."""
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key)
    return at + len(key)


def _tensor_fields(data: bytes, name: str) -> tuple[int, int, int]:
    """The byte positions of a 2-D tensor's first dimension, its type and its offset."""
    at = _info(data, name)
    assert struct.unpack_from("<I", data, at)[0] == 2
    return at + 4, at + 20, at + 24


def _put(data: bytes, at: int, fmt: str, value: float) -> bytes:
    edited = bytearray(data)
    struct.pack_into(fmt, edited, at, value)
    return bytes(edited)


def _value_at(data: bytes, key: str) -> int:
    """Where the value of the metadata `key` starts (an array's: its element type)."""
    encoded = struct.pack("<Q", len(key)) + key.encode()
    return data.index(encoded) + len(encoded) + 4


# ---- The file's structure ---------------------------------------------------------------------------


def test_a_file_cut_in_its_tensor_data_names_the_tensor_that_runs_past_the_end(
    tmp_path: Any, valid: bytes
) -> None:
    error = _refused(tmp_path, valid[:-100], "run past the end of the file")
    assert "tensor " in error.reason and "truncated" in error.reason


def test_a_file_cut_in_its_metadata_is_truncated(tmp_path: Any, valid: bytes) -> None:
    _refused(tmp_path, valid[:1000], "the file is truncated or corrupt")
    _refused(tmp_path, valid[:10], "shorter than a GGUF header")


def test_a_tensor_past_the_end_of_the_file_is_named(tmp_path: Any, valid: bytes) -> None:
    _, _, offset = _tensor_fields(valid, "blk.1.ffn_up.weight")
    bad = _put(valid, offset, "<Q", 1 << 40)
    _refused(tmp_path, bad, r"tensor blk\.1\.ffn_up\.weight's \d+ bytes at byte \d+ run past the end")


def test_overlapping_tensors_are_named(tmp_path: Any, valid: bytes) -> None:
    _, _, up = _tensor_fields(valid, "blk.1.ffn_up.weight")
    _, _, gate = _tensor_fields(valid, "blk.1.ffn_gate.weight")
    bad = _put(valid, up, "<Q", struct.unpack_from("<Q", valid, gate)[0])
    _refused(
        tmp_path, bad, r"tensors blk\.1\.ffn_(gate|up)\.weight and blk\.1\.ffn_(gate|up)\.weight overlap"
    )


def test_misaligned_tensor_data_is_named(tmp_path: Any, valid: bytes) -> None:
    _, _, offset = _tensor_fields(valid, "blk.0.attn_v.weight")
    bad = _put(valid, offset, "<Q", struct.unpack_from("<Q", valid, offset)[0] + 4)
    _refused(tmp_path, bad, r"tensor blk\.0\.attn_v\.weight's data at offset \d+ is not aligned to 32 bytes")


def test_an_alignment_that_is_not_a_power_of_two_is_refused(tmp_path: Any, folder: str) -> None:
    path = _write(
        folder, str(tmp_path / "aligned.gguf"), extra=lambda w: w.add_uint32("general.alignment", 48)
    )
    with open(path, "rb") as f:
        _refused(tmp_path, f.read(), "general.alignment 48 is not a power of two")


def test_dimensions_whose_product_overflows_are_refused(tmp_path: Any, valid: bytes) -> None:
    dims, _, _ = _tensor_fields(valid, "blk.0.attn_v.weight")
    bad = _put(_put(valid, dims, "<Q", 1 << 32), dims + 8, "<Q", 1 << 32)
    _refused(tmp_path, bad, r"tensor blk\.0\.attn_v\.weight's dimensions \[4294967296, 4294967296\] overflow")


def test_rows_that_are_not_whole_blocks_are_refused(tmp_path: Any, valid: bytes) -> None:
    dims, _, _ = _tensor_fields(valid, "blk.0.attn_v.weight")
    bad = _put(valid, dims, "<Q", 33)
    _refused(
        tmp_path, bad, r"tensor blk\.0\.attn_v\.weight's rows of 33 elements are not whole blocks of Q8_0"
    )


def test_a_type_code_out_of_range_is_named(tmp_path: Any, valid: bytes) -> None:
    _, qtype, _ = _tensor_fields(valid, "blk.0.attn_v.weight")
    _refused(tmp_path, _put(valid, qtype, "<I", 77), r"tensor blk\.0\.attn_v\.weight has type code 77")


def test_a_type_nothing_in_kvserve_reads_is_named_with_its_type(tmp_path: Any, valid: bytes) -> None:
    """I8 (one byte a weight, so the tensor still fits its bytes): neither the kernels nor the gguf
    package's dequantizer read it."""
    _, qtype, _ = _tensor_fields(valid, "blk.0.attn_v.weight")
    bad = _put(valid, qtype, "<I", gguf.GGMLQuantizationType.I8)
    _refused(tmp_path, bad, r"tensor blk\.0\.attn_v\.weight is of I8, which neither kvserve's kernels nor")


# ---- Counts and lengths the file claims ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "skip", "message"),
    [
        ("tokenizer.ggml.tokens", 4, "claims 1152921504606846976 strings"),
        ("tokenizer.ggml.token_type", 4, "claims 1152921504606846976 values of 4 bytes"),
    ],
)
def test_an_array_of_2_60_elements_is_refused_at_its_header(
    tmp_path: Any, valid: bytes, key: str, skip: int, message: str
) -> None:
    bad = _put(valid, _value_at(valid, key) + skip, "<Q", 1 << 60)
    error = _refused(tmp_path, bad, message)
    assert key in error.reason


def test_a_string_of_2_62_bytes_is_refused(tmp_path: Any, valid: bytes) -> None:
    bad = _put(valid, _value_at(valid, "general.architecture"), "<Q", 1 << 62)
    _refused(
        tmp_path,
        bad,
        r"the metadata general\.architecture at byte \d+ \(4611686018427387904 bytes\) runs past",
    )
    # A key's length, and a tensor name's.
    key = b"general.architecture"
    bad = _put(valid, valid.index(key) - 8, "<Q", 1 << 62)
    _refused(tmp_path, bad, "metadata key 0 at byte .* runs past the end")
    bad = _put(valid, _info(valid, "token_embd.weight") - len("token_embd.weight") - 8, "<Q", 1 << 62)
    _refused(tmp_path, bad, r"the name of tensor \d+ at byte .* runs past the end")


@pytest.mark.parametrize(("at", "what"), [(8, "tensors"), (16, "metadata entries")])
def test_header_counts_beyond_the_file_are_refused(tmp_path: Any, valid: bytes, at: int, what: str) -> None:
    _refused(tmp_path, _put(valid, at, "<Q", 1 << 60), f"the header claims 1152921504606846976 {what}")


def test_other_headers_are_refused(tmp_path: Any, valid: bytes) -> None:
    _refused(tmp_path, b"GGUX" + valid[4:], "no GGUF magic")
    _refused(tmp_path, _put(valid, 4, "<I", 1), "GGUF version 1")
    _refused(tmp_path, _put(valid, 4, ">I", 3), "big-endian")
    n_dims = _info(valid, "blk.0.attn_v.weight")
    _refused(tmp_path, _put(valid, n_dims, "<I", 9), r"tensor blk\.0\.attn_v\.weight has 9 dimensions")


# ---- Metadata that disagrees with the tensors ----------------------------------------------------------


def _scalar(valid: bytes, key: str, fmt: str, value: int) -> bytes:
    return _put(valid, _value_at(valid, key), fmt, value)


def test_a_head_count_the_attention_rows_do_not_have_is_refused(tmp_path: Any, valid: bytes) -> None:
    """Four heads of 16 in the file (key_length 16): eight heads make q 128 rows."""
    bad = _scalar(valid, f"{ARCH}.attention.head_count", "<I", 8)
    message = r"tensor blk\.0\.attn_q\.weight is \[64, 64\] but head_count 8, .* make it \[128, 64\]"
    _refused(tmp_path, bad, message)


def test_a_hidden_size_the_embedding_does_not_have_is_refused(tmp_path: Any, valid: bytes) -> None:
    bad = _scalar(valid, f"{ARCH}.embedding_length", "<I", 96)
    _refused(tmp_path, bad, r"tensor token_embd\.weight is \[\d+, 64\] but llama\.embedding_length 96")


@pytest.mark.parametrize(
    ("count", "message"),
    [
        (3, "block_count is 3 but the file holds no tensor of layer 2"),
        (1, "block_count is 1 but the file holds tensors of layer 1"),
        (2**32 - 1, "block_count is 4294967295 but the file holds no tensor of layer 2"),
        (0, "block_count must be a positive integer"),
    ],
)
def test_a_block_count_other_than_the_layers_present_is_refused(
    tmp_path: Any, valid: bytes, count: int, message: str
) -> None:
    _refused(tmp_path, _scalar(valid, f"{ARCH}.block_count", "<I", count), message)


def test_a_vocabulary_size_other_than_the_tokenizers_is_refused(tmp_path: Any, folder: str) -> None:
    tokens = len(tiny_vocabulary(ARCH))
    path = _write(folder, str(tmp_path / "v.gguf"), extra=lambda w: w.add_vocab_size(tokens + 1))
    with open(path, "rb") as f:
        _refused(
            tmp_path, f.read(), f"the tokenizer has {tokens} tokens but llama.vocab_size is {tokens + 1}"
        )


def test_an_embedding_of_another_vocabulary_is_refused(tmp_path: Any, folder: str) -> None:
    def fewer_rows(name: str, w: Any) -> Any:
        return w[:-32] if name == "model.embed_tokens.weight" else w

    path = _write(folder, str(tmp_path / "e.gguf"), tamper=fewer_rows)
    tokens = len(tiny_vocabulary(ARCH))
    with open(path, "rb") as f:
        _refused(
            tmp_path,
            f.read(),
            rf"tensor token_embd\.weight is \[{tokens - 32}, 64\] .* make it \[{tokens}, 64\]",
        )


def test_a_special_token_outside_the_vocabulary_is_refused(tmp_path: Any, valid: bytes) -> None:
    bad = _scalar(valid, "tokenizer.ggml.eos_token_id", "<I", 10**6)
    _refused(tmp_path, bad, "tokenizer.ggml.eos_token_id 1000000 is not one of the tokenizer's")


def test_metadata_of_the_wrong_type_is_one_error(tmp_path: Any, valid: bytes) -> None:
    """The context length as a float32 infinity: not an integer."""
    at = _value_at(valid, f"{ARCH}.context_length")
    bad = _put(_put(valid, at - 4, "<I", 6), at, "<f", float("inf"))
    _refused(tmp_path, bad, "the GGUF metadata does not make a model config")


# ---- Rope: the context length and Llama 3's frequency factors -----------------------------------------


@pytest.mark.parametrize("length", [2**40, 2**24 + 1, 0])
def test_a_context_length_no_rope_table_could_hold_is_refused(
    tmp_path: Any, folder: str, monkeypatch: pytest.MonkeyPatch, length: int
) -> None:
    """Refused at load, before the engine sizes its rope tables (or anything else) by it."""

    def context_length(writer: gguf.GGUFWriter, _: int) -> None:
        writer.add_uint64(f"{ARCH}.context_length", length)

    monkeypatch.setattr(gguf.GGUFWriter, "add_context_length", context_length)
    path = _write(folder, str(tmp_path / "context.gguf"))
    with open(path, "rb") as f:
        _refused(tmp_path, f.read(), rf"llama\.context_length {length} is not a context kvserve serves")


def test_the_rope_tables_hold_no_position_the_pool_cannot(
    tmp_path: Any, folder: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The longest context a file may claim, served by default: the tables stop at the pool's tokens."""
    monkeypatch.setattr(
        gguf.GGUFWriter, "add_context_length", lambda w, _: w.add_uint32(f"{ARCH}.context_length", 2**24)
    )
    model = load_model(_write(folder, str(tmp_path / "long.gguf")), str(tmp_path / "cache"))
    assert model.config.max_position_embeddings == 2**24
    runner = ModelRunner(model, 16, 4, 2**24, "cpu", "float32", "float32")
    assert runner.transformer.rotary.cos.shape[0] == 16 * 4


def _rope_freqs(values: list[float]) -> Callable[[gguf.GGUFWriter], None]:
    return lambda w: w.add_tensor("rope_freqs.weight", np.array(values, dtype=np.float32))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([1.0] * 5, r"tensor rope_freqs\.weight is \[5\] but the rotary dimension makes it \[8\]"),
        ([1.0] * 7 + [float("nan")], r"tensor rope_freqs\.weight holds the factor nan, outside"),
        ([1.0] * 7 + [float("inf")], r"tensor rope_freqs\.weight holds the factor inf, outside"),
        ([0.0] + [1.0] * 7, r"tensor rope_freqs\.weight holds the factor 0\.0, outside"),
        ([-8.0] + [1.0] * 7, r"tensor rope_freqs\.weight holds the factor -8\.0, outside"),
        ([1e30] + [1.0] * 7, r"tensor rope_freqs\.weight holds the factor 1\.0\d*e\+30, outside"),
    ],
)
def test_rope_frequency_factors_of_another_shape_or_out_of_range_are_refused(
    tmp_path: Any, folder: str, values: list[float], message: str
) -> None:
    path = _write(folder, str(tmp_path / "freqs.gguf"), extra=_rope_freqs(values))
    with open(path, "rb") as f:
        _refused(tmp_path, f.read(), message)


def test_rope_frequency_factors_of_a_family_that_takes_none_are_refused(tmp_path: Any) -> None:
    """Gemma 3's llama.cpp graph reads no rope_freqs: serving without them would rotate otherwise than
    the file means."""
    family, overrides = gguf_case("gemma3")
    source = save_tiny_model(str(tmp_path / "gemma3"), family, **overrides)
    path = str(tmp_path / "gemma3.gguf")
    write_family_gguf(source, path, family, False, extra=_rope_freqs([1.0] * 8))
    with open(path, "rb") as f:
        _refused(tmp_path, f.read(), r"tensor rope_freqs\.weight: the gemma3 family takes no factors")


# ---- Anything else ----------------------------------------------------------------------------------


def _mutations() -> st.SearchStrategy[Callable[[bytes, int], bytes]]:
    """A cut, or up to four bytes set at random, half of them in the header (metadata and tensor infos)."""

    def cut(fraction: float) -> Callable[[bytes, int], bytes]:
        return lambda data, header: data[: int(len(data) * fraction)]

    def flips(places: list[tuple[bool, float, int]]) -> Callable[[bytes, int], bytes]:
        def apply(data: bytes, header: int) -> bytes:
            edited = bytearray(data)
            for in_header, where, value in places:
                span = header if in_header else len(data)
                edited[int(where * span) % len(data)] = value
            return bytes(edited)

        return apply

    place = st.tuples(st.booleans(), st.floats(0, 1, exclude_max=True), st.integers(0, 255))
    return st.one_of(
        st.floats(0, 1, exclude_max=True).map(cut), st.lists(place, min_size=1, max_size=4).map(flips)
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutation=_mutations())
def test_random_damage_loads_or_is_one_model_load_error(tmp_path: Any, valid: bytes, mutation: Any) -> None:
    header = min(t.offset for t in _valid_file(tmp_path, valid).tensors.values())
    path = str(tmp_path / "damaged.gguf")
    with open(path, "wb") as f:
        f.write(mutation(valid, header))
    try:
        model = load_model(path, str(tmp_path / "cache"))
    except ModelLoadError as e:
        assert e.path == path
        return
    for name in model.weights:
        model.weights[name]
    for name in model.quantized:
        model.quantized[name].rows(torch.tensor([0]))


def _valid_file(tmp_path: Any, valid: bytes) -> Any:
    path = str(tmp_path / "valid.gguf")
    if not os.path.exists(path):
        with open(path, "wb") as f:
            f.write(valid)
    return open_gguf(path)
