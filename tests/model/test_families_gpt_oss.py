"""gpt-oss against transformers' GptOssForCausalLM on tiny random float32 weights, from a Hugging Face
folder and from a GGUF written with the gguf package (experts in MXFP4, llama.cpp's layout): logits at
every prompt position and every greedy step within 1e-4 of transformers', the same greedy tokens, on a
prompt longer than the sliding window and run as several prefill chunks.

The pieces that differ from the other families each change the logits past the tolerance when dropped
(the sinks here; the others show in the parity itself): attention sinks, alternating sliding and global
layers, YaRN rope with an unrounded correction range, the router's bias and softmax over the top-k,
the experts' biases and clamped SwiGLU.
"""

from typing import Any

import numpy as np
import pytest
import torch

from kvserve.config import default_cache_dir
from kvserve.errors import ModelLoadError
from kvserve.model.loader import load_model
from kvserve.model.moe import SparseMoe
from kvserve.model.native_attention import NativeAttention
from kvserve.model.quant_linear import QuantLinear
from kvserve.model.runner import ForwardBatch, ModelRunner, SequenceChunk
from tests.helpers import save_tiny_model
from tests.model.family_cases import exact_runner, hf_logits, random_prompt
from tests.model.gguf_families import tiny_vocabulary

WINDOW = 8
PROMPT = 45
CHUNK = 16
STEPS = 6
FIELDS: dict[str, Any] = {
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "head_dim": 16,
    "sliding_window": WINDOW,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "tie_word_embeddings": False,
    # Small enough that the clamp bites on some rows and not on others.
    "swiglu_limit": 3.0,
}


def tiny_gpt_oss(path: str, **overrides: Any) -> Any:
    import transformers

    vocabulary = tiny_vocabulary("qwen2")
    save_tiny_model(
        path,
        "gpt_oss",
        **{
            **FIELDS,
            "vocab_size": len(vocabulary),
            "bos_token_id": vocabulary.bos,
            "eos_token_id": vocabulary.eos,
            "pad_token_id": vocabulary.eos,
            **overrides,
        },
    )
    model = transformers.GptOssForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    return model


def chunked_and_greedy(runner: ModelRunner, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """The prompt's logits prefilled in chunks of CHUNK tokens, then `steps` greedy decodes."""
    table = list(range(-(-(len(prompt) + steps) // 4)))
    rows = []
    for start in range(0, len(prompt), CHUNK):
        chunk = SequenceChunk(prompt[start : start + CHUNK], start, table, True, all_logits=True)
        out = runner.execute(ForwardBatch(prefills=[chunk]))
        rows.append(out.chunks[0])
    ids = list(prompt)
    logits = rows[-1][-1]
    for _ in range(steps):
        ids.append(int(logits.argmax()))
        chunk = SequenceChunk(ids[-1:], len(ids) - 1, table, True)
        logits = runner.execute(ForwardBatch(decodes=[chunk])).sampled[0]
        rows.append(logits.unsqueeze(0))
    return torch.cat(rows), ids[len(prompt) :]


def check_parity(runner: ModelRunner, theirs: Any, tolerance: float = 1e-4) -> float:
    prompt = random_prompt(PROMPT, seed=3, vocab=theirs.config.vocab_size)
    logits, tokens = chunked_and_greedy(runner, prompt, STEPS)
    with torch.no_grad():
        expected_tokens = theirs.generate(
            torch.tensor([prompt]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False
        )[0, PROMPT:].tolist()
    assert tokens == expected_tokens
    expected = hf_logits(theirs, prompt + tokens)[: PROMPT + STEPS]
    torch.testing.assert_close(logits, expected, atol=tolerance, rtol=tolerance)
    return float((logits - expected).abs().max())


def test_a_hugging_face_folder_matches_transformers(tmp_path: Any) -> None:
    path = str(tmp_path / "oss")
    theirs = tiny_gpt_oss(path)
    ours = load_model(path, default_cache_dir())
    c = ours.config
    assert c.attention_sinks and c.windows == (WINDOW, None)
    assert c.rope_scaling_dict["rope_type"] == "yarn" and c.rope_scaling_dict["truncate"] is False
    runner = exact_runner(ours)
    assert isinstance(runner.attention, NativeAttention)
    error = check_parity(runner, theirs)
    print(f"gpt_oss safetensors: max abs logit error {error:.2e}")


def test_sink_attention_in_slices_of_rows_matches_too(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch backend (the sinks' portable path) bounds a long chunk's scores by computing sink rows a
    slice at a time: here a few rows per slice."""
    from kvserve.model import torch_attention

    monkeypatch.setattr(torch_attention, "_SINK_SCORES_BYTES", 1024)
    path = str(tmp_path / "oss")
    theirs = tiny_gpt_oss(path)
    model = load_model(path, default_cache_dir())
    runner = ModelRunner(
        model, 160, 4, 512, "cpu", "float32", "float32", attention="torch", kv_dtype="float32"
    )
    assert isinstance(runner.attention, torch_attention.TorchAttention)
    check_parity(runner, theirs)


def test_dropping_the_sinks_breaks_parity(tmp_path: Any) -> None:
    """The parity above sees the sinks: without them the logits move past the tolerance."""
    path = str(tmp_path / "oss")
    theirs = tiny_gpt_oss(path)
    runner = exact_runner(load_model(path, default_cache_dir()))
    for layer in runner.transformer.layers:
        layer.sinks = None
    with pytest.raises(AssertionError):
        check_parity(runner, theirs)


# ---- GGUF -------------------------------------------------------------------------------------------


def write_gguf(model: Any, path: str, skip: str = "") -> None:
    """llama.cpp's gpt-oss GGUF of transformers' `model`: the experts' products in MXFP4 (the gguf
    package's quantizer), everything else F32; `model` takes the dequantized values the file holds.
    `skip`: a tensor left out."""
    import gguf
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    c = model.config
    writer = gguf.GGUFWriter(path, "gpt-oss")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(c.rope_parameters["factor"])
    writer.add_rope_scaling_orig_ctx_len(c.rope_parameters["original_max_position_embeddings"])
    writer.add_sliding_window(c.sliding_window)
    writer.add_expert_count(c.num_local_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_feed_forward_length(c.intermediate_size)
    vocabulary = tiny_vocabulary("qwen2")
    writer.add_tokenizer_model(vocabulary.model)
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_types(vocabulary.types)
    writer.add_token_merges(vocabulary.merges)
    writer.add_bos_token_id(vocabulary.bos)
    writer.add_eos_token_id(vocabulary.eos)
    inner = model.model

    def add(name: str, t: torch.Tensor) -> None:
        if name == skip:
            return
        writer.add_tensor(name, np.ascontiguousarray(t.detach().float().numpy()))

    def add_mxfp4(name: str, w: torch.Tensor) -> torch.Tensor:
        """`w` [experts, out, in] as MXFP4 blocks; returns the values the file holds."""
        data = quantize(np.ascontiguousarray(w.numpy()), GGMLQuantizationType.MXFP4)
        writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType.MXFP4)
        values = np.asarray(dequantize(data, GGMLQuantizationType.MXFP4), dtype=np.float32)
        return torch.from_numpy(values).view(w.shape)

    add("token_embd.weight", inner.embed_tokens.weight)
    add("output_norm.weight", inner.norm.weight)
    add("output.weight", model.lm_head.weight)
    for i, layer in enumerate(inner.layers):
        b = f"blk.{i}."
        a = layer.self_attn
        add(b + "attn_norm.weight", layer.input_layernorm.weight)
        add(b + "post_attention_norm.weight", layer.post_attention_layernorm.weight)
        for name, proj in (
            ("attn_q", a.q_proj),
            ("attn_k", a.k_proj),
            ("attn_v", a.v_proj),
            ("attn_output", a.o_proj),
        ):
            add(b + name + ".weight", proj.weight)
            add(b + name + ".bias", proj.bias)
        add(b + "attn_sinks.weight", a.sinks)
        add(b + "ffn_gate_inp.weight", layer.mlp.router.weight)
        add(b + "ffn_gate_inp.bias", layer.mlp.router.bias)
        experts = layer.mlp.experts
        with torch.no_grad():
            gate_up, bias = experts.gate_up_proj, experts.gate_up_proj_bias
            # llama.cpp's converter splits the interleaved columns and stores [experts, out, in].
            gate = add_mxfp4(b + "ffn_gate_exps.weight", gate_up[:, :, 0::2].transpose(1, 2))
            up = add_mxfp4(b + "ffn_up_exps.weight", gate_up[:, :, 1::2].transpose(1, 2))
            down = add_mxfp4(b + "ffn_down_exps.weight", experts.down_proj.transpose(1, 2))
            gate_up[:, :, 0::2] = gate.transpose(1, 2)
            gate_up[:, :, 1::2] = up.transpose(1, 2)
            experts.down_proj.copy_(down.transpose(1, 2))
        add(b + "ffn_gate_exps.bias", bias[:, 0::2])
        add(b + "ffn_up_exps.bias", bias[:, 1::2])
        add(b + "ffn_down_exps.bias", experts.down_proj_bias)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("weight_dtype", ["float32", "gguf"])
def test_a_gguf_with_mxfp4_experts_matches_transformers(tmp_path: Any, weight_dtype: str) -> None:
    theirs = tiny_gpt_oss(str(tmp_path / "oss"))
    path = str(tmp_path / "oss.gguf")
    write_gguf(theirs, path)
    ours = load_model(path, default_cache_dir())
    c = ours.config
    assert c.attention_sinks and c.windows == (WINDOW, None) and c.moe is not None
    runner = exact_runner(ours, weight_dtype=weight_dtype)
    first = runner.transformer.layers[0].mlp
    assert isinstance(first, SparseMoe) and first.router_bias is not None
    if weight_dtype == "gguf":
        assert all(isinstance(p, QuantLinear) for e in first.experts for p in (e.gate, e.up, e.down))
    error = check_parity(runner, theirs)
    print(f"gpt_oss gguf mxfp4 ({weight_dtype}): max abs logit error {error:.2e}")


def test_a_router_that_disagrees_with_the_config_is_one_error_at_load(tmp_path: Any) -> None:
    import json
    import os

    path = str(tmp_path / "oss")
    tiny_gpt_oss(path)
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["num_local_experts"] = 6
    with open(config_path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ModelLoadError, match="6 experts but the router has 4"):
        exact_runner(load_model(path, default_cache_dir()))


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        ("blk.1.attn_sinks.weight", "self_attn.sinks"),
        ("blk.0.ffn_gate_inp.bias", "mlp.router.bias"),
        ("blk.0.ffn_up_exps.bias", "up_proj.bias"),
    ],
)
def test_a_gguf_missing_a_gpt_oss_tensor_is_one_error_at_load(tmp_path: Any, drop: str, message: str) -> None:
    theirs = tiny_gpt_oss(str(tmp_path / "oss"))
    out = str(tmp_path / "less.gguf")
    write_gguf(theirs, out, skip=drop)
    with pytest.raises(ModelLoadError, match=message):
        exact_runner(load_model(out, default_cache_dir()))


def _openai_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`w` [experts, out, in] quantized by the gguf package to MXFP4, as OpenAI's checkpoints hold it:
    (blocks [experts, out, in / 32, 16], weights 2j and 2j + 1 in byte j's low and high nibbles;
    scales [experts, out, in / 32]; the float values)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    data = quantize(np.ascontiguousarray(w.numpy()), GGMLQuantizationType.MXFP4)
    values = torch.from_numpy(np.asarray(dequantize(data, GGMLQuantizationType.MXFP4), dtype=np.float32))
    ggml = data.reshape(*w.shape[:2], -1, 17)
    scales = ggml[..., 0]
    codes = np.concatenate([ggml[..., 1:] & 0x0F, ggml[..., 1:] >> 4], axis=-1)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return torch.from_numpy(blocks), torch.from_numpy(np.ascontiguousarray(scales)), values.view(w.shape)


@pytest.mark.parametrize("weight_dtype", ["float32", "gguf"])
def test_openais_mxfp4_safetensors_match_transformers(tmp_path: Any, weight_dtype: str) -> None:
    """The experts as OpenAI's checkpoints keep them (`*_blocks`, `*_scales`), against transformers on
    their float values. Under weight_dtype gguf the experts run on their MXFP4 blocks and a folder's
    other matrices in float16 (kvserve's rule for float weights there): within float16's rounding."""
    from safetensors.torch import load_file, save_file

    path = str(tmp_path / "oss")
    theirs = tiny_gpt_oss(path)
    tensors = load_file(f"{path}/model.safetensors")
    with torch.no_grad():
        for i, layer in enumerate(theirs.model.layers):
            experts = layer.mlp.experts
            p = f"model.layers.{i}.mlp.experts."
            for name, param in (("gate_up_proj", experts.gate_up_proj), ("down_proj", experts.down_proj)):
                blocks, scales, values = _openai_mxfp4(param.transpose(1, 2).contiguous())
                param.copy_(values.transpose(1, 2))
                del tensors[p + name]
                tensors[p + name + "_blocks"] = blocks
                tensors[p + name + "_scales"] = scales
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    ours = load_model(path, default_cache_dir())
    runner = exact_runner(ours, weight_dtype=weight_dtype)
    first = runner.transformer.layers[0].mlp
    assert isinstance(first, SparseMoe)
    if weight_dtype == "gguf":
        assert all(isinstance(p, QuantLinear) for e in first.experts for p in (e.gate, e.up, e.down))
    check_parity(runner, theirs, 1e-4 if weight_dtype == "float32" else 2e-3)


def test_an_mxfp4_block_that_overflows_is_refused_at_load(tmp_path: Any) -> None:
    """A scale byte of 255 under a code of 6 makes an infinite weight: the load names the tensor."""
    from kvserve.model.gguf_file import open_gguf

    theirs = tiny_gpt_oss(str(tmp_path / "oss"))
    path = str(tmp_path / "oss.gguf")
    write_gguf(theirs, path)
    t = open_gguf(path).tensors["blk.1.ffn_down_exps.weight"]
    with open(path, "r+b") as f:
        f.seek(t.offset + 17 * 3)  # the fourth block: its scale byte, then its codes
        f.write(bytes([255]) + bytes([0x77] * 16))
    with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_down_exps\.weight holds NaN or infinity"):
        load_model(path, default_cache_dir())
