"""A weight that is NaN or infinite is refused at load, naming the tensor: in a GGUF from its float values
or its blocks' scales read in place (a Q8_0 and a Q6_K matrix, an F32 norm), in a folder as the tensor is
read. Before, such a model loaded and served NaN. The table of where each ggml type keeps its scales is
checked against the gguf package's dequantizer: finite scales give finite weights whatever the quants,
and an infinite one does not."""

import os
import struct
from typing import Any

import gguf
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file

from kvserve.errors import ModelLoadError
from kvserve.model import finite_weights, gguf_file
from kvserve.model.gguf_file import open_gguf
from kvserve.model.loader import load_model
from kvserve.model.runner import ModelRunner
from tests.model.gguf_families import save_tiny_llama, write_family_gguf

ARCH = "llama"
F16_INF, F16_NAN, F16_ONE = 0x7C00, 0x7E00, 0x3C00


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_llama(str(tmp_path_factory.mktemp("finite") / "llama"))


@pytest.fixture(scope="module")
def valid(folder: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("valid") / "valid.gguf")
    write_family_gguf(folder, path, ARCH, True)
    load_model(path, str(tmp_path_factory.mktemp("cache")))
    return path


@pytest.mark.parametrize(
    ("tensor", "block", "at", "fmt", "value"),
    [
        ("blk.0.attn_v.weight", 5, 0, "<H", F16_NAN),  # Q8_0: d
        ("blk.1.ffn_down.weight", 3, 208, "<H", F16_INF),  # Q6_K: d, after the quants and sub-scales
        ("blk.1.attn_norm.weight", 7, 0, "<f", float("inf")),  # F32: a value (block: the index)
        ("output_norm.weight", 0, 0, "<f", float("nan")),
    ],
)
def test_a_gguf_weight_that_is_not_finite_is_refused_at_load(
    valid: str, tmp_path: Any, tensor: str, block: int, at: int, fmt: str, value: float
) -> None:
    t = open_gguf(valid).tensors[tensor]
    block_bytes = (
        4
        if t.qtype == gguf.GGMLQuantizationType.F32
        else GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t.qtype)][1]
    )
    with open(valid, "rb") as f:
        data = bytearray(f.read())
    struct.pack_into(fmt, data, t.offset + block * block_bytes + at, value)
    path = str(tmp_path / "bad.gguf")
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(ModelLoadError, match=rf"tensor {tensor} holds NaN or infinity") as e:
        load_model(path, str(tmp_path / "cache"))
    assert e.value.path == path


def test_a_safetensors_weight_that_is_not_finite_is_refused_as_the_model_is_built(
    folder: str, tmp_path: Any
) -> None:
    path = str(tmp_path / "nan")
    os.makedirs(path)
    for name in os.listdir(folder):
        if name != "model.safetensors":
            with open(os.path.join(folder, name), "rb") as src, open(os.path.join(path, name), "wb") as dst:
                dst.write(src.read())
    weights = load_file(os.path.join(folder, "model.safetensors"))
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] = float("-inf")
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    model = load_model(path, str(tmp_path / "cache"))
    with pytest.raises(
        ModelLoadError, match=r"tensor model\.layers\.1\.mlp\.up_proj\.weight holds NaN or inf"
    ):
        ModelRunner(model, 8, 4, 64, "cpu", "float32", "float32")


@pytest.mark.parametrize(
    "qtype", sorted(finite_weights._SCALES), ids=lambda q: gguf.GGMLQuantizationType(q).name
)
def test_the_scale_table_is_where_the_dequantizer_reads_the_scales(qtype: int) -> None:
    kind = gguf.GGMLQuantizationType(qtype)
    _, block_bytes = GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(qtype)
    blocks = rng.integers(0, 256, size=(64, block_bytes), dtype=np.uint8)
    scales = finite_weights._SCALES[qtype]
    one = {
        2: np.frombuffer(struct.pack("<H", F16_ONE), np.uint8),
        4: np.frombuffer(struct.pack("<f", 1), np.uint8),
    }
    for at, width in scales:
        blocks[:, at : at + width] = one[width]
    assert np.isfinite(dequantize(blocks, kind)).all()
    for at, width in scales:
        bad = blocks.copy()
        inf = struct.pack("<H", F16_INF) if width == 2 else struct.pack("<f", float("inf"))
        bad[17, at : at + width] = np.frombuffer(inf, np.uint8)
        with np.errstate(invalid="ignore", over="ignore"):
            assert not np.isfinite(dequantize(bad, kind)).all()


def test_tensors_of_the_types_without_plain_scales_are_dequantized_to_be_checked(
    valid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A type missing from the table (here Q8_0, taken out of it) is still checked, a chunk at a time."""
    monkeypatch.delitem(finite_weights._SCALES, gguf.GGMLQuantizationType.Q8_0)
    calls: list[int] = []
    dequantize_rows = gguf_file.dequantize

    def counted(rows: np.ndarray, qtype: int) -> np.ndarray:
        calls.append(qtype)
        values: np.ndarray = dequantize_rows(rows, qtype)
        return values

    monkeypatch.setattr(finite_weights, "dequantize", counted)
    finite_weights.check_gguf(open_gguf(valid))
    assert calls and set(calls) == {gguf.GGMLQuantizationType.Q8_0}


def test_mxfp4_blocks_are_finite_exactly_below_the_scale_bound() -> None:
    """For every scale byte and every code, gguf's dequantized MXFP4 value is finite whenever the scale is
    at most `_MXFP4_FINITE`, and some code overflows above it: the scan skips exactly the safe blocks."""
    kind = gguf.GGMLQuantizationType.MXFP4
    _, block_bytes = GGML_QUANT_SIZES[kind]
    codes = np.arange(256, dtype=np.uint8)  # each byte: two 4-bit codes, so all 16 codes appear
    for scale in range(256):
        blocks = np.zeros((16, block_bytes), dtype=np.uint8)
        blocks[:, 0] = scale
        blocks[:, 1:] = codes.reshape(16, 16)
        with np.errstate(invalid="ignore", over="ignore"):
            finite = bool(np.isfinite(dequantize(blocks, kind)).all())
        assert finite == (scale <= finite_weights._MXFP4_FINITE), scale
