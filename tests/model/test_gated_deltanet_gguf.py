"""A Qwen3.5 GGUF as llama.cpp's converter writes it (arch `qwen35`, its ssm.* keys, the DeltaNet's tensors
tiled by value head): the family's config from the metadata, the tensors under the family's names, and the
layer built from the file, F32 against transformers' layer to 1e-5 and Q8_0 through the native block
products against the same file's float values."""

from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize

from kvserve.config import default_cache_dir
from kvserve.model.families.base import GgufMetadata
from kvserve.model.families.qwen3_5 import QWEN3_5, QWEN3_5_MOE
from kvserve.model.gated_deltanet import gated_deltanet
from kvserve.model.gguf_file import open_gguf
from kvserve.model.gguf_weights import GgufBlocks, GgufTensors, GgufWeights, check_against_config
from kvserve.model.quant_linear import QuantLinear
from kvserve.model.spec import ModelConfig
from kvserve.model.weights import ModelWeights
from tests.model.deltanet_cases import HIDDEN, Pool, llamacpp_layout, reference_layer, rows_of, text_config

# Tiny layers: one thread avoids a hand-off per small op.
pytestmark = pytest.mark.usefixtures("one_thread")

MATRICES = ("attn_qkv.weight", "attn_gate.weight", "ssm_alpha.weight", "ssm_beta.weight", "ssm_out.weight")


def write_gguf(
    path: Path,
    qtype: gguf.GGMLQuantizationType,
    recurrent_array: bool = False,
    overrides: dict[str, object] | None = None,
    arch: str = "qwen35",
    extra: dict[str, np.ndarray] | None = None,
) -> None:
    """A one-DeltaNet-layer file of `reference_layer`'s weights; `overrides` replace metadata values."""
    hf = text_config()
    layer = llamacpp_layout(reference_layer(hf).state_dict(), hf)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(4)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(48)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(16)
    w.add_value_length(16)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e7)
    w.add_rope_dimension_count(4)
    w.add_rope_dimension_sections([1, 1, 0, 0])
    w.add_vocab_size(64)
    w.add_ssm_conv_kernel(4)
    w.add_ssm_state_size(8)
    w.add_ssm_group_count(2)
    w.add_ssm_time_step_rank(4)
    w.add_ssm_inner_size(32)
    if recurrent_array:
        w.add_array(f"{arch}.attention.recurrent_layers", [True, False, True, False])
    else:
        w.add_full_attention_interval(4)
    for key, value in (overrides or {}).items():
        # Written again, a key's value replaces the first.
        if isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_uint32(key, int(value))  # type: ignore[call-overload]
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(64)])
    w.add_tensor("token_embd.weight", np.zeros((64, HIDDEN), dtype=np.float32))
    for name, array in (extra or {}).items():
        w.add_tensor(name, array)
    for name, t in layer.items():
        data = t.numpy().astype(np.float32)
        if name in MATRICES and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(f"blk.0.{name}", quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(f"blk.0.{name}", data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read(path: Path, weight_dtype: str) -> tuple[ModelConfig, ModelWeights]:
    file = open_gguf(str(path))
    meta = GgufMetadata(file)
    assert QWEN3_5.gguf_config is not None
    config = QWEN3_5.config(QWEN3_5.gguf_config(meta))
    tensors = GgufTensors(file, QWEN3_5, (config.num_heads, config.num_kv_heads))
    weights = ModelWeights(
        GgufWeights(tensors), GgufBlocks(tensors), torch.device("cpu"), torch.float32, weight_dtype,
        default_cache_dir(), False, 1.0,
    )  # fmt: skip
    return config, weights


def test_config_from_the_metadata(tmp_path: Path) -> None:
    for array in (False, True):
        path = tmp_path / f"m{array}.gguf"
        write_gguf(path, gguf.GGMLQuantizationType.F32, recurrent_array=array)
        config, _ = read(path, "gguf")
        dn = config.deltanet
        assert dn is not None and dn.v_heads_tiled
        assert dn.layers == ((True, True, True, False) if not array else (True, False, True, False))
        sizes = (dn.num_k_heads, dn.num_v_heads, dn.k_head_dim, dn.v_head_dim, dn.conv_kernel)
        assert sizes == (2, 4, 8, 8, 4)
        assert config.rotary_dim == 4 and config.head_dim == 16 and config.attention_output_gate


def test_a_layer_from_an_f32_file_matches_transformers(tmp_path: Path) -> None:
    path = tmp_path / "f32.gguf"
    write_gguf(path, gguf.GGMLQuantizationType.F32)
    config, weights = read(path, "gguf")
    layer = gated_deltanet(weights, config, "model.layers.0.")
    x = torch.randn(90, HIDDEN, generator=torch.Generator().manual_seed(7))
    out = layer.forward(x, rows_of([90], [0]), Pool.for_layer(layer).states)
    with torch.no_grad():
        expected = reference_layer(text_config())(x.unsqueeze(0))[0]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_a_q8_0_file_runs_its_blocks_natively(tmp_path: Path) -> None:
    path = tmp_path / "q8.gguf"
    write_gguf(path, gguf.GGMLQuantizationType.Q8_0)
    config, weights = read(path, "gguf")
    native = gated_deltanet(weights, config, "model.layers.0.")
    if not isinstance(native.qkv, QuantLinear):
        pytest.skip("the native block kernels cannot be built here")
    assert all(isinstance(p, QuantLinear) for p in (native.z, native.a, native.b, native.out))
    _, floats = read(path, "float32")
    reference = gated_deltanet(floats, config, "model.layers.0.")
    x = torch.randn(70, HIDDEN, generator=torch.Generator().manual_seed(8))
    out = native.forward(x, rows_of([70], [0]), Pool.for_layer(native).states)
    want = reference.forward(x, rows_of([70], [0]), Pool.for_layer(reference).states)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def test_a_sequences_bits_do_not_depend_on_its_batch(tmp_path: Path) -> None:
    """With the native block products (each row's product the same bits in any batch), a sequence's rows
    and state are the same bits alone as beside others: a decode, a 100-row and a 7-row prompt."""
    path = tmp_path / "q8.gguf"
    write_gguf(path, gguf.GGMLQuantizationType.Q8_0)
    config, weights = read(path, "gguf")
    layer = gated_deltanet(weights, config, "model.layers.0.")
    if not isinstance(layer.qkv, QuantLinear):
        pytest.skip("the native block kernels cannot be built here")
    gen = torch.Generator().manual_seed(9)
    history = torch.randn(30, HIDDEN, generator=gen)
    seqs = [torch.randn(n, HIDDEN, generator=gen) for n in (1, 100, 7)]

    def run(chosen: list[int]) -> dict[int, tuple[torch.Tensor, ...]]:
        pool = Pool.for_layer(layer)
        layer.forward(history, rows_of([30], [0]), pool.states)
        x = torch.cat([seqs[j] for j in chosen])
        out = layer.forward(x, rows_of([seqs[j].shape[0] for j in chosen], chosen), pool.states)
        parts = torch.split(out, [seqs[j].shape[0] for j in chosen])
        return {j: (part, pool.delta[j], pool.conv[j]) for j, part in zip(chosen, parts, strict=True)}

    together = run([0, 1, 2])
    for alone in (run([0]), run([1]), run([2]), run([0, 2])):
        for j, found in alone.items():
            assert all(torch.equal(a, b) for a, b in zip(found, together[j], strict=True))


def test_the_files_shapes_are_checked_against_the_config(tmp_path: Path) -> None:
    path = tmp_path / "f32.gguf"
    write_gguf(path, gguf.GGMLQuantizationType.F32)
    file = open_gguf(str(path))
    config, _ = read(path, "gguf")
    # The DeltaNet's attn_qkv is its own q, k and v, not the attention's.
    check_against_config(file, GgufMetadata(file), config)
    assert config.deltanet is not None
    wrong = replace(config, deltanet=replace(config.deltanet, k_head_dim=4))
    with pytest.raises(Exception, match="attn_qkv"):
        check_against_config(file, GgufMetadata(file), wrong)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("qwen35.ssm.group_count", 3, "multiple"),
        ("qwen35.ssm.inner_size", 30, "whole heads"),
        ("qwen35.ssm.time_step_rank", 0, "whole heads"),
        ("qwen35.ssm.conv_kernel", 1 << 20, "linear_conv_kernel_dim"),
        ("qwen35.attention.recurrent_layers", [True, False], "layer_types"),
        ("qwen35.full_attention_interval", 0, "full_attention_interval"),
    ],
)
def test_hostile_metadata_for_the_new_layers_is_one_clear_error(
    tmp_path: Path, key: str, value: object, message: str
) -> None:
    path = tmp_path / "m.gguf"
    write_gguf(path, gguf.GGMLQuantizationType.F32, overrides={key: value})
    meta = GgufMetadata(open_gguf(str(path)))
    assert QWEN3_5.gguf_config is not None
    with pytest.raises(ValueError, match=message):
        QWEN3_5.config(QWEN3_5.gguf_config(meta))


def test_a_state_of_another_shape_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "f32.gguf"
    write_gguf(path, gguf.GGMLQuantizationType.F32)
    config, weights = read(path, "gguf")
    layer = gated_deltanet(weights, config, "model.layers.0.")
    pool = Pool.for_layer(layer)
    with pytest.raises(ValueError, match="state of shapes"):
        layer.forward(torch.zeros(2, HIDDEN), rows_of([2], [0]), (pool.conv[:, :, :2], pool.delta))


@pytest.mark.parametrize("shared_key", [True, False])
def test_moe_config_from_the_metadata(tmp_path: Path, shared_key: bool) -> None:
    """qwen35moe's expert keys; without the shared expert's key, its size is its tensors'."""
    keys: dict[str, object] = {
        "qwen35moe.expert_count": 4,
        "qwen35moe.expert_used_count": 2,
        "qwen35moe.expert_feed_forward_length": 12,
    }
    if shared_key:
        keys["qwen35moe.expert_shared_feed_forward_length"] = 20
    shared_up = {"blk.0.ffn_up_shexp.weight": np.zeros((20, HIDDEN), dtype=np.float32)}
    path = tmp_path / "moe.gguf"
    write_gguf(path, gguf.GGMLQuantizationType.F32, overrides=keys, arch="qwen35moe", extra=shared_up)
    meta = GgufMetadata(open_gguf(str(path)))
    assert QWEN3_5_MOE.gguf_config is not None
    config = QWEN3_5_MOE.config(QWEN3_5_MOE.gguf_config(meta))
    assert config.moe is not None and config.deltanet is not None and config.deltanet.v_heads_tiled
    assert (config.moe.num_experts, config.moe.top_k, config.moe.expert_intermediate_size) == (4, 2, 12)
    assert config.moe.shared_expert_intermediate_size == 20 and config.moe.norm_topk_prob
