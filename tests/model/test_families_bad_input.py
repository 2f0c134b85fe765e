"""Bad model files of the new families are each refused at load with one clear error: a GGUF with a
missing or a mismatched tensor, and config fields whose math is not implemented (an unknown rope type
or activation, logit soft-capping, unknown layer types)."""

import json
import os
from typing import Any

import numpy as np
import pytest

from kvserve.errors import ModelLoadError
from kvserve.model.loader import load_model
from kvserve.model.runner import ModelRunner
from tests.helpers import save_tiny_model
from tests.model.family_cases import CASES, gguf_case
from tests.model.gguf_families import write_family_gguf


def _runner(path: str, cache: str, weight_dtype: str) -> ModelRunner:
    return ModelRunner(load_model(path, cache), 8, 4, 64, "cpu", "float32", weight_dtype)


def _gguf(tmp_path: Any, case: str, quantized: bool, tamper: Any) -> str:
    family, overrides = gguf_case(case)
    folder = save_tiny_model(str(tmp_path / case), family, **overrides)
    path = str(tmp_path / f"{case}.gguf")
    write_family_gguf(folder, path, family, quantized, tamper)
    return path


@pytest.mark.parametrize("quantized", [False, True], ids=["F32", "Q8_0"])
@pytest.mark.parametrize(
    ("case", "tensor"),
    [
        ("qwen3", "model.layers.1.self_attn.k_norm.weight"),
        ("gemma3", "model.layers.0.post_feedforward_layernorm.weight"),
        ("phi3-longrope", "model.layers.1.mlp.gate_up_proj.weight"),
    ],
)
def test_a_gguf_missing_a_tensor_is_refused_naming_it(
    tmp_path: Any, case: str, tensor: str, quantized: bool
) -> None:
    path = _gguf(tmp_path, case, quantized, lambda name, w: None if name == tensor else w)
    with pytest.raises(ModelLoadError, match="missing") as e:
        _runner(path, str(tmp_path / "cache"), "gguf" if quantized else "float32")
    assert e.value.path == tensor


@pytest.mark.parametrize("quantized", [False, True], ids=["F32", "Q8_0"])
@pytest.mark.parametrize(
    ("case", "tensor", "gguf_name"),
    [
        ("qwen3", "model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight"),
        ("smollm3-nope", "model.layers.1.mlp.up_proj.weight", None),
        ("phi3-longrope", "model.layers.0.self_attn.qkv_proj.weight", "blk.0.attn_qkv.weight"),
        ("gemma3", "model.layers.1.self_attn.q_norm.weight", None),
    ],
)
def test_a_gguf_with_a_mismatched_tensor_is_refused_naming_it(
    tmp_path: Any, case: str, tensor: str, gguf_name: str | None, quantized: bool
) -> None:
    """A tensor whose shape is not the config's (rows short) is refused at load, not at the first step:
    the attention products by the metadata's head counts as the file is read (naming the file and the
    tensor), every other tensor as the model is built (naming the tensor)."""
    cut = 8 if "norm" in tensor else 32
    path = _gguf(tmp_path, case, quantized, lambda name, w: w[:-cut] if name == tensor else w)
    if gguf_name is not None:
        with pytest.raises(ModelLoadError, match=rf"tensor {gguf_name} is \[.*\] but head_count") as e:
            load_model(path, str(tmp_path / "cache"))
        assert e.value.path == path
        return
    with pytest.raises(ModelLoadError, match="does not match the config") as e:
        _runner(path, str(tmp_path / "cache"), "gguf" if quantized else "float32")
    assert e.value.path == tensor


def _edited(tmp_path: Any, case: str, edit: dict[str, Any]) -> str:
    family, overrides = CASES[case]
    path = save_tiny_model(str(tmp_path / case), family, **overrides)
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        raw = json.load(f)
    for key, value in edit.items():
        target = raw
        *parents, leaf = key.split(".")
        for parent in parents:
            target = target[parent]
        target[leaf] = value
    with open(config_path, "w") as f:
        json.dump(raw, f)
    return path


@pytest.mark.parametrize(
    ("case", "edit", "message"),
    [
        ("qwen3", {"rope_parameters.rope_type": "dynamic"}, "rope scaling 'dynamic' is not supported"),
        ("phi3-longrope", {"rope_parameters.rope_type": "ntk"}, "rope scaling 'ntk' is not supported"),
        (
            "gemma3",
            {"rope_parameters.full_attention.rope_type": "dynamic"},
            "rope scaling 'dynamic' is not supported",
        ),
        (
            "gemma3",
            {"rope_parameters.sliding_attention.rope_type": "linear"},
            "rope scaling 'linear' on the sliding",
        ),
        ("qwen3", {"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
        ("gemma3", {"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
        ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping is not supported"),
        ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is not supported"),
        ("gemma3", {"layer_types": ["chunked_attention"] * 4}, "layer_types must name"),
        ("smollm3-nope", {"no_rope_layers": [1, 0]}, "no_rope_layers must hold"),
        ("phi3-longrope", {"partial_rotary_factor": 0.33}, "partial_rotary_factor 0.33 leaves no even"),
        ("qwen3", {"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
        ("gemma3", {"num_attention_heads": 0}, "num_attention_heads must be positive"),
        ("smollm3-nope", {"intermediate_size": -1}, "intermediate_size must be positive"),
    ],
)
def test_config_fields_whose_math_is_not_implemented_are_refused(
    tmp_path: Any, case: str, edit: dict[str, Any], message: str
) -> None:
    with pytest.raises(ModelLoadError, match=message):
        load_model(_edited(tmp_path, case, edit), str(tmp_path / "cache"))


def test_longrope_factors_of_the_wrong_length_are_refused(tmp_path: Any) -> None:
    path = _edited(tmp_path, "phi3-longrope", {"rope_parameters.short_factor": [1.0, 1.0]})
    with pytest.raises(ModelLoadError, match="longrope factors must number 4"):
        load_model(path, str(tmp_path / "cache"))


def test_an_unsupported_gguf_architecture_is_named(tmp_path: Any) -> None:
    import gguf

    path = str(tmp_path / "other.gguf")
    writer = gguf.GGUFWriter(path, "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'mamba'"):
        load_model(path, str(tmp_path / "cache"))
