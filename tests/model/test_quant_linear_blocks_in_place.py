"""Under gguf weights the model is resident once: the products read the blocks as loaded, in place (no
copy of them is made), and a tied embedding's lookup reads the head's rows with the same values bit for
bit."""

import dataclasses
import subprocess
import sys

import pytest
import torch

from kvserve.config import EngineConfig, default_cache_dir
from kvserve.engine.factory import build_parts
from kvserve.model.loader import LoadedModel
from kvserve.model.quant_blocks import Q4_0, Q4_1, Q8_0, QuantizedWeight
from kvserve.model.quant_linear import QuantLinear
from kvserve.model.runner import ModelRunner
from tests.model.test_quant_blocks_native_kernel import gguf_blocks, random_weight


def _own_copy(model: LoadedModel) -> LoadedModel:
    """`model` with blocks of its own (the session's model keeps its blocks for other tests)."""
    blocks = {n: QuantizedWeight(q.qtype, q.data.clone(), q.in_features) for n, q in model.quantized.items()}
    return dataclasses.replace(model, quantized=blocks)


def test_the_products_read_the_blocks_as_loaded_in_place(default_model: LoadedModel) -> None:
    model = _own_copy(default_model)
    loaded = {q.data.data_ptr() for q in model.quantized.values()}
    runner = ModelRunner(model, 8, 16, 64, "cpu", "float32", "gguf", "auto")
    assert runner.transformer.decoder is not None, "the default model runs the native decoder"
    layer = runner.transformer.layers[0]
    products = [runner.transformer.lm_head, layer.qkv, layer.o, layer.gate, layer.up, layer.down]
    for product in products:
        assert isinstance(product, QuantLinear)
        assert all(p.data.data_ptr() in loaded for p in product.weight.parts)


def test_the_tied_embedding_reads_the_heads_copy_with_the_loaded_rows_values(
    default_model: LoadedModel,
) -> None:
    runner = ModelRunner(default_model, 8, 16, 64, "cpu", "float32", "gguf", "auto")
    transformer = runner.transformer
    assert transformer.embed_blocks is transformer.lm_head
    ids = torch.tensor([[0, 1, 2, 3, 4], [17, 4096, 49150, 49151, 17]])
    expected = default_model.quantized["model.embed_tokens.weight"].rows(ids)
    assert torch.equal(transformer.embedding(ids.reshape(-1)), expected.reshape(-1, expected.shape[-1]))


@pytest.mark.parametrize("qtype", [Q8_0, Q4_0, Q4_1], ids=["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("n_out", [1, 4, 7, 66])
def test_a_products_rows_are_the_loaded_rows(qtype: int, n_out: int) -> None:
    blocks = gguf_blocks(random_weight(n_out, 96, seed=n_out), qtype)
    linear = QuantLinear(blocks, None, default_cache_dir())
    index = torch.tensor([n_out - 1, 0, n_out // 2, n_out - 1, 0])
    assert torch.equal(linear.rows(index), blocks.rows(index))
    every = torch.arange(n_out)
    assert torch.equal(linear.rows(every), blocks.dequantize())


def test_an_engine_that_loads_its_model_keeps_no_block_as_loaded() -> None:
    """The runner's products hold the blocks they read: the loaded model the engine keeps holds none."""
    parts = build_parts(EngineConfig(kv_cache_memory=16 * 2**20))
    assert parts.model.quantized == {}
    assert isinstance(parts.runner.transformer.lm_head, QuantLinear)


def test_serving_never_loads_torchs_compiler_stack() -> None:
    """torch.compile's modules (about 120 MiB resident) are not imported by the server, its engine or the
    grammar masks (the grammar library's torch helpers compile a kernel at import)."""
    code = (
        "import sys\n"
        "import kvserve.cli, kvserve.server.app, kvserve.engine.masks, kvserve.engine.grammar\n"
        "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
