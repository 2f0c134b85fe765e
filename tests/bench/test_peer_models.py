"""The random-weight GGUFs of benchmarks/peer_models.py, at each shape's tiny size: the gguf package reads
the intended Q4_K_M type for every tensor (Q5_0 exactly where a Q4_K matrix's rows are not a multiple of
256, Q6_K for the head and the down and V projections of llama.cpp's `use_more_bits` layers, Q4_K
elsewhere), weights of about std 0.02; and kvserve loads each family's file and generates."""

import os
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from benchmarks.peer_models import SHAPES, Shape, write_gguf
from gguf import GGMLQuantizationType as Q

from kvserve.config import EngineConfig
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams

# Slow by hand (tests/conftest.py cannot see it): writing each shape's files and converting them at load
# takes about a minute of `make test-fast` for benchmark files that serving never reads.
pytestmark = pytest.mark.slow

# use_more_bits of 8 layers: the first eighth, the last eighth, and every third between.
MORE_BITS = {0, 3, 6, 7}


# The tiny hybrids' V projections by layer that get more bits: use_more_bits over the attention layers
# alone (Qwen3.5's at 3 and 7: the second of 2; LFM2's at 2 and 5: the second of 2).
HYBRID_V_MORE_BITS = {"qwen3_5": {7}, "lfm2": {5}}
UNQUANTIZED = ("ffn_gate_inp", "ssm_conv1d", "shortconv.conv", ".bias", "rope_freqs")


def expected_type(shape: Shape, name: str, n_in: int, ndim: int) -> Q:
    """The type a Q4_K_M (gpt-oss: MXFP4_MOE) file gives the tensor, written out from llama.cpp's rules
    for these shapes."""
    if ndim == 1 or any(part in name for part in UNQUANTIZED):
        return Q.F32
    if shape.family == "gpt_oss":
        return Q.MXFP4 if ndim == 3 else Q.Q8_0
    config = shape.config
    fits = n_in % 256 == 0
    if name == "output.weight" or (name == "token_embd.weight" and config["tie_word_embeddings"]):
        return Q.Q6_K if fits else Q.Q8_0
    layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
    eight_experts = config.get("num_experts") == 8
    if eight_experts and ("attn_k." in name or "attn_v." in name):
        return Q.Q8_0
    if eight_experts and "attn_output" in name:
        return Q.Q5_K if fits else Q.Q5_1
    if "attn_qkv" in name:
        return Q.Q5_K if fits else Q.Q5_1
    v_more_bits = HYBRID_V_MORE_BITS.get(shape.family, MORE_BITS)
    if ("ffn_down" in name and layer in MORE_BITS) or ("attn_v." in name and layer in v_more_bits):
        return Q.Q6_K if fits else Q.Q8_0
    return Q.Q4_K if fits else Q.Q5_0


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: Any) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("peer-models")
    paths = {}
    for name, shape in SHAPES.items():
        paths[name] = str(folder / f"{name}.gguf")
        write_gguf(shape.tiny(), paths[name])
    return paths


@pytest.fixture(scope="module")
def family_cache(tmp_path_factory: Any) -> str:
    """One cache folder for every family's load: each file's tokenizer folder is its own, and the kernels
    are built once (a fresh folder per load rebuilt them: most of each load's time)."""
    return str(tmp_path_factory.mktemp("peer-cache"))


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_each_tensor_has_its_q4_k_m_type(tiny_files: dict[str, str], name: str) -> None:
    shape = SHAPES[name].tiny()
    reader = gguf.GGUFReader(tiny_files[name])
    seen: dict[Q, int] = {}
    for t in reader.tensors:
        kind = Q(t.tensor_type)
        assert kind == expected_type(shape, t.name, int(t.shape[0]), len(t.shape)), t.name
        seen[kind] = seen.get(kind, 0) + 1
        if kind != Q.F32 and seen[kind] == 1 and t.n_elements <= 1 << 20:
            values = np.asarray(gguf.quants.dequantize(t.data, kind), dtype=np.float32)
            assert np.isfinite(values).all() and 0.01 < values.std() < 0.04, t.name
            assert abs(values.mean()) < 0.01, t.name
    if shape.family == "gpt_oss":
        assert set(seen) == {Q.F32, Q.Q8_0, Q.MXFP4}
        return
    # Each tiny shape keeps its checkpoint's mix: Q5_0 only where the real hidden size is not a multiple
    # of 256 (Gemma 3's 640 and 1152, Qwen2.5-0.5B's 896), the head Q6_K or Q8_0 accordingly.
    odd = SHAPES[name].config["hidden_size"] % 256 != 0
    assert (Q.Q5_0 in seen) == odd and (Q.Q8_0 in seen) == (odd or name == "qwen3-moe-small")
    assert seen[Q.Q6_K] >= len(MORE_BITS) and seen[Q.Q4_K] > 0
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert (
        len(tokens.data)
        == reader.fields[f"{reader.fields['general.architecture'].contents()}.vocab_size"].contents()
    )


def test_the_real_sizes_hold_the_real_vocabularies() -> None:
    assert {name: s.config["vocab_size"] for name, s in SHAPES.items()} == {
        "gemma3-270m": 262144,
        "gemma3-1b": 262144,
        "qwen3-0.6b": 151936,
        "qwen3-1.7b": 151936,
        "qwen2.5-0.5b": 151936,
        "qwen2.5-1.5b": 151936,
        "llama3.2-1b": 128256,
        "qwen3-moe-small": 151936,
        "qwen3.5-0.8b": 248320,
        "lfm2-350m": 65536,
        "lfm2-1.2b": 65536,
        "gpt-oss-small": 201088,
    }


# One shape of each family (the others differ from these only in sizes); by default the three whose
# files differ most (sentencepiece vocabulary and sliding windows; Q5_0 and biases; experts, Q5_K and an
# untied head), every family with KVSERVE_LONG_TESTS=1 (each load builds the file's tokenizer: seconds).
_LONG = os.environ.get("KVSERVE_LONG_TESTS") == "1"
_SLOW = pytest.mark.skipif(not _LONG, reason="slow: KVSERVE_LONG_TESTS=1")


@pytest.mark.parametrize(
    "name",
    [
        "gemma3-270m",
        "qwen2.5-0.5b",
        "qwen3-moe-small",
        "qwen3.5-0.8b",
        "lfm2-350m",
        "gpt-oss-small",
        pytest.param("qwen3-0.6b", marks=_SLOW),
        pytest.param("llama3.2-1b", marks=_SLOW),
    ],
)
def test_kvserve_loads_each_family_and_generates(
    tiny_files: dict[str, str], family_cache: str, name: str
) -> None:
    torch.set_num_threads(2)
    engine = Engine.from_config(
        EngineConfig(model=tiny_files[name], cache_dir=family_cache, kv_cache_memory=16 * 2**20)
    )
    prompt = engine.tokenizer.encode("Hello world, how are you?")
    assert engine.tokenizer.decode(prompt).endswith("Hello world, how are you?")
    engine.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += delta.token_ids
    engine.close()
    assert len(tokens) == 4 and all(0 <= t < engine.model.config.vocab_size for t in tokens)
