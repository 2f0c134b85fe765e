"""The weight precision setting: validated in EngineConfig, exposed on the CLI, carried down to the model."""

from typing import Any

import pytest

from kvserve.cli import build_parser, engine_config
from kvserve.config import EngineConfig, default_cache_dir
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.linear import Fp16Linear, Int8Linear, Linear
from kvserve.model.loader import LoadedModel, load_model
from kvserve.model.quant_blocks import Q4_1, Q8_0
from kvserve.model.quant_linear import QuantLinear
from tests.helpers import save_tiny_model


@pytest.mark.parametrize(
    "fields",
    [
        {"weight_dtype": "int4"},
        {"weight_dtype": "int8", "device": "cuda"},
        {"weight_dtype": "int8", "dtype": "bfloat16"},
    ],
)
def test_unsupported_weight_dtypes_are_refused_at_startup(fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="weight_dtype"):
        EngineConfig(**fields)


@pytest.mark.parametrize("command", ["serve", "chat", "generate"])
def test_every_model_command_takes_weight_dtype(command: str) -> None:
    extra = ["hello"] if command == "generate" else []
    args = build_parser().parse_args([command, "--weight-dtype", "int8", *extra])
    assert engine_config(args).weight_dtype == "int8"
    default = build_parser().parse_args([command, *extra])
    assert engine_config(default).weight_dtype == EngineConfig().weight_dtype
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--weight-dtype", "int4", *extra])


@pytest.mark.parametrize(
    ("weight_dtype", "kind"), [("float16", Fp16Linear), ("int8", Int8Linear), ("q8_0", QuantLinear)]
)
def test_the_engine_builds_every_linear_in_its_weight_dtype(
    tmp_path: Any, weight_dtype: str, kind: type[Linear]
) -> None:
    model = load_model(save_tiny_model(str(tmp_path / "tiny"), "llama"), default_cache_dir())
    engine = Engine.from_config(EngineConfig(kv_cache_memory=2**22, weight_dtype=weight_dtype), model=model)
    transformer = engine.runner.transformer
    layer = transformer.layers[0]
    for linear in (transformer.lm_head, layer.qkv, layer.o, layer.gate, layer.up, layer.down):
        assert isinstance(linear, kind)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(100, 140)), params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        tokens += [t for delta in engine.step() for t in delta.token_ids]
    assert len(tokens) == 5


def test_gguf_runs_the_default_models_own_blocks(default_model: LoadedModel) -> None:
    """Its 210 linears are Q4_1 in the file and the tied embedding and lm_head Q8_0: all run as shipped."""
    engine = Engine.from_config(EngineConfig(kv_cache_memory=2**22, weight_dtype="gguf"), model=default_model)
    transformer = engine.runner.transformer
    assert isinstance(transformer.lm_head, QuantLinear) and transformer.lm_head.weight.qtype == Q8_0
    for layer in transformer.layers:
        for linear in (layer.qkv, layer.o, layer.gate, layer.up, layer.down):
            assert isinstance(linear, QuantLinear) and linear.weight.qtype == Q4_1


def test_gguf_without_blocks_is_float16(tmp_path: Any) -> None:
    model = load_model(save_tiny_model(str(tmp_path / "tiny"), "llama"), default_cache_dir())
    assert model.quantized == {}
    engine = Engine.from_config(EngineConfig(kv_cache_memory=2**22, weight_dtype="gguf"), model=model)
    assert isinstance(engine.runner.transformer.layers[0].qkv, Fp16Linear)
