"""Qwen3-MoE against transformers' Qwen3MoeForCausalLM on tiny random float32 weights, from a Hugging
Face folder and from GGUF files written with the gguf package, with the experts unevenly used: logits at
every prompt position and at every greedy step within 1e-4 of transformers', and the same greedy tokens.

Uneven use: channel 0 of every embedding row is large and positive, the attention norms and the final
norm zero it (so attention and logits ignore it), and each router row leans on it by its own amount, so
that expert 0 takes nearly every token and the last expert none. A quantized GGUF is compared with
transformers on its dequantized weights.
"""

import os
from typing import Any

import numpy as np
import pytest
import torch

from kvserve.config import default_cache_dir
from kvserve.errors import ModelLoadError
from kvserve.model.loader import load_model
from kvserve.model.moe import SparseMoe
from kvserve.model.quant_linear import QuantLinear
from tests.helpers import save_tiny_model
from tests.model.family_cases import exact_runner, hf_logits, prompt_and_greedy, random_prompt
from tests.model.gguf_families import tiny_vocabulary

EXPERTS = 6
MOE: dict[str, Any] = {
    "num_experts": EXPERTS,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
    "head_dim": 16,
}
# Each router row's lean on channel 0: expert 0 first, the last never.
LEAN = [1.0, 0.6, 0.4, 0.2, 0.0, -4.0]
WRITE_SCALE = 0.1
PROMPT = 37
STEPS = 6


def make_uneven(model: Any) -> Any:
    """`model` (transformers') with the lean on channel 0 described above, in place."""
    with torch.no_grad():
        inner = model.model
        # As large as the rest of an embedding row together (its 0.2-scaled entries).
        inner.embed_tokens.weight[:, 0] = 0.2 * model.config.hidden_size**0.5
        inner.norm.weight[0] = 0.0
        for layer in inner.layers:
            layer.input_layernorm.weight[0] = 0.0
            layer.post_attention_layernorm.weight.fill_(1.0)
            # Nothing writes to channel 0 after the embedding, and the layers' writes are small enough
            # that channel 0 keeps its share of every layer's norm.
            writes = [layer.self_attn.o_proj.weight]
            if hasattr(layer.mlp, "experts"):
                writes.append(layer.mlp.experts.down_proj.transpose(0, 1))
                layer.mlp.gate.weight[:, 0] = torch.tensor(LEAN)
            else:
                writes.append(layer.mlp.down_proj.weight)
            for w in writes:
                w.mul_(WRITE_SCALE)
                w[0] = 0.0
    return model


def vocabulary_fields() -> dict[str, Any]:
    """The config fields of the family GGUF tests' tiny vocabulary (tests/model/gguf_families.py): a
    few hundred rows of embedding keep every test here fast, from safetensors too."""
    vocabulary = tiny_vocabulary("qwen3")
    return {
        "vocab_size": len(vocabulary),
        "bos_token_id": vocabulary.bos,
        "eos_token_id": vocabulary.eos,
        "pad_token_id": vocabulary.eos,
    }


def tiny_moe(path: str, **overrides: Any) -> Any:
    """A saved tiny Qwen3-MoE made uneven; returns transformers' model read back from the folder."""
    import transformers

    save_tiny_model(path, "qwen3_moe", **{**MOE, **vocabulary_fields(), **overrides})
    model = transformers.Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    make_uneven(model)
    model.save_pretrained(path, safe_serialization=True)
    return model


def expert_use(model: Any, ids: list[int]) -> torch.Tensor:
    """How many tokens each expert took, over every sparse layer, in transformers' own routing."""
    counts = torch.zeros(EXPERTS, dtype=torch.long)

    def hook(module: Any, args: Any, out: Any) -> None:
        counts.add_(torch.bincount(out[2].reshape(-1), minlength=EXPERTS))

    handles = [
        layer.mlp.gate.register_forward_hook(hook)
        for layer in model.model.layers
        if hasattr(layer.mlp, "experts")
    ]
    try:
        hf_logits(model, ids)
    finally:
        for h in handles:
            h.remove()
    return counts


def check_parity(ours: Any, theirs: Any, weight_dtype: str) -> float:
    prompt = random_prompt(PROMPT, seed=1, vocab=theirs.config.vocab_size)
    counts = expert_use(theirs, prompt)
    assert counts[-1] == 0 and counts[0] >= counts.sum() // 3 and (counts > 0).sum() >= 4, counts
    logits, tokens = prompt_and_greedy(exact_runner(ours, weight_dtype=weight_dtype), prompt, STEPS)
    with torch.no_grad():
        expected_tokens = theirs.generate(
            torch.tensor([prompt]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False
        )[0, PROMPT:].tolist()
    assert tokens == expected_tokens
    expected = hf_logits(theirs, prompt + tokens)[: PROMPT + STEPS]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    return float((logits - expected).abs().max())


def test_a_hugging_face_folder_matches_transformers(tmp_path: Any) -> None:
    """Three layers, the middle one dense (`mlp_only_layers`)."""
    path = str(tmp_path / "moe")
    theirs = tiny_moe(path, num_hidden_layers=3, mlp_only_layers=[1])
    ours = load_model(path, default_cache_dir())
    assert ours.config.moe is not None and ours.config.moe.sparse_layers == (True, False, True)
    error = check_parity(ours, theirs, "float32")
    print(f"qwen3_moe safetensors: max abs logit error {error:.2e}")


def test_decoder_sparse_step_picks_the_sparse_layers(tmp_path: Any) -> None:
    path = str(tmp_path / "moe")
    theirs = tiny_moe(path, num_hidden_layers=4, decoder_sparse_step=2)
    ours = load_model(path, default_cache_dir())
    assert ours.config.moe is not None and ours.config.moe.sparse_layers == (False, True, False, True)
    check_parity(ours, theirs, "float32")


# ---- GGUF -------------------------------------------------------------------------------------------

# The experts' block types: F32 (exact), Q8_0 (the gguf package's quantizer) and Q4_K (random
# super-blocks with small scales: the package quantizes no K-quant).
EXPERT_TYPES = ("F32", "Q8_0", "Q4_K")


def expert_blocks(w: np.ndarray, kind: str, seed: int) -> tuple[np.ndarray, np.ndarray, Any]:
    """(the file's data, its dequantized float32 values, the ggml type) of the 3-D expert tensor `w`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    qtype = GGMLQuantizationType[kind]
    if kind == "F32":
        return w, w, qtype
    if kind == "Q8_0":
        data = quantize(w, qtype)
    else:
        rng = np.random.default_rng(seed)
        experts, rows, n_in = w.shape
        data = rng.integers(0, 256, size=(experts, rows, n_in // 256 * 144), dtype=np.uint8)
        scales = (rng.random((experts, rows, n_in // 256, 2)) * 3e-4).astype(np.float16).view(np.uint8)
        data.reshape(experts, rows, n_in // 256, 144)[..., 0:4] = scales.reshape(
            experts, rows, n_in // 256, 4
        )
    values = np.asarray(dequantize(data, qtype), dtype=np.float32).reshape(w.shape)
    return data, values, qtype


def write_gguf(
    model: Any, path: str, kind: str, expert_count: int | None = None, fused: bool = False
) -> None:
    """llama.cpp's Qwen3-MoE GGUF of transformers' `model`: the experts' products as `kind`, the other
    matrices F32 or (in a quantized file) Q8_0; `model` takes the dequantized values the file holds.
    `fused`: the experts' gate and up rows in one tensor, as newer converters write them."""
    import gguf
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    c = model.config
    writer = gguf.GGUFWriter(path, "qwen3moe")
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
    writer.add_expert_count(expert_count or c.num_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    vocabulary = tiny_vocabulary("qwen3")
    writer.add_tokenizer_model(vocabulary.model)
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_types(vocabulary.types)
    writer.add_token_merges(vocabulary.merges)
    writer.add_bos_token_id(vocabulary.bos)
    writer.add_eos_token_id(vocabulary.eos)
    inner = model.model

    def add(name: str, t: torch.Tensor) -> None:
        """A norm or the router in F32 (llama.cpp quantizes neither); another matrix in Q8_0 in a
        quantized file, `t` taking the values it holds."""
        w = np.ascontiguousarray(t.detach().float().numpy())
        if kind == "F32" or w.ndim != 2 or "norm" in name or "gate_inp" in name:
            writer.add_tensor(name, w)
            return
        data = quantize(w, GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType.Q8_0)
        with torch.no_grad():
            t.copy_(torch.from_numpy(np.asarray(dequantize(data, GGMLQuantizationType.Q8_0))).view(t.shape))

    add("token_embd.weight", inner.embed_tokens.weight)
    add("output_norm.weight", inner.norm.weight)
    add("output.weight", model.lm_head.weight)
    inter = c.moe_intermediate_size
    for i, layer in enumerate(inner.layers):
        b = f"blk.{i}."
        a = layer.self_attn
        for name, t in (
            ("attn_norm", layer.input_layernorm.weight),
            ("attn_q", a.q_proj.weight),
            ("attn_k", a.k_proj.weight),
            ("attn_v", a.v_proj.weight),
            ("attn_output", a.o_proj.weight),
            ("attn_q_norm", a.q_norm.weight),
            ("attn_k_norm", a.k_norm.weight),
            ("ffn_norm", layer.post_attention_layernorm.weight),
            ("ffn_gate_inp", layer.mlp.gate.weight),
        ):
            add(b + name + ".weight", t)
        experts = layer.mlp.experts
        with torch.no_grad():
            gate_up, down = experts.gate_up_proj, experts.down_proj
            halves = (("ffn_gate_exps", gate_up[:, :inter]), ("ffn_up_exps", gate_up[:, inter:]))
            fused_or_not = (("ffn_gate_up_exps", gate_up),) if fused else halves
            for j, (name, w) in enumerate((*fused_or_not, ("ffn_down_exps", down))):
                data, values, qtype = expert_blocks(np.ascontiguousarray(w.numpy()), kind, seed=i * 3 + j)
                writer.add_tensor(b + name + ".weight", data, raw_dtype=qtype)
                w.copy_(torch.from_numpy(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("kind", EXPERT_TYPES)
def test_a_gguf_matches_transformers_on_its_dequantized_weights(tmp_path: Any, kind: str) -> None:
    """Every layer sparse (llama.cpp's Qwen3-MoE has no dense layer); K-quant rows are 256 wide."""
    size = 256 if kind == "Q4_K" else 64
    theirs = tiny_moe(
        str(tmp_path / "moe"),
        hidden_size=size,
        moe_intermediate_size=size,
        tie_word_embeddings=False,
    )
    path = str(tmp_path / f"moe-{kind}.gguf")
    write_gguf(theirs, path, kind)
    ours = load_model(path, default_cache_dir())
    moe = ours.config.moe
    assert moe is not None and moe.norm_topk_prob and moe.sparse_layers == (True, True)
    weight_dtype = "float32" if kind == "F32" else "gguf"
    runner = exact_runner(ours, weight_dtype=weight_dtype)
    first = runner.transformer.layers[0].mlp
    assert isinstance(first, SparseMoe)
    if kind != "F32":
        assert all(isinstance(p, QuantLinear) for e in first.experts for p in (e.gate, e.up, e.down))
    error = check_parity(ours, theirs, weight_dtype)
    print(f"qwen3_moe gguf {kind}: max abs logit error {error:.2e}")


@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
def test_a_gguf_with_fused_gate_and_up_experts_matches_transformers(tmp_path: Any, kind: str) -> None:
    """`ffn_gate_up_exps` (transformers' `gate_up_proj` as one tensor): its first half of rows is each
    expert's gate, its second the up projection, read natively from the file's blocks."""
    theirs = tiny_moe(str(tmp_path / "moe"), tie_word_embeddings=False)
    path = str(tmp_path / f"fused-{kind}.gguf")
    write_gguf(theirs, path, kind, fused=True)
    ours = load_model(path, default_cache_dir())
    weight_dtype = "float32" if kind == "F32" else "gguf"
    if kind != "F32":
        first = exact_runner(ours, weight_dtype=weight_dtype).transformer.layers[0].mlp
        assert isinstance(first, SparseMoe)
        assert all(isinstance(p, QuantLinear) for e in first.experts for p in (e.gate, e.up))
    error = check_parity(ours, theirs, weight_dtype)
    print(f"qwen3_moe gguf fused {kind}: max abs logit error {error:.2e}")


def test_a_fused_gate_and_up_tensor_of_odd_rows_is_one_error_at_load(tmp_path: Any) -> None:
    theirs = tiny_moe(str(tmp_path / "moe"))
    for layer in theirs.model.layers:
        experts = layer.mlp.experts
        odd = torch.cat([experts.gate_up_proj.detach(), experts.gate_up_proj.detach()[:, :1]], 1)
        experts.gate_up_proj = torch.nn.Parameter(odd)
    path = str(tmp_path / "odd.gguf")
    write_gguf(theirs, path, "F32", fused=True)
    with pytest.raises(ModelLoadError, match="even count of rows"):
        load_model(path, default_cache_dir())


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_an_expert_count_that_does_not_match_the_tensors_is_one_error_at_load(
    tmp_path: Any, source: str
) -> None:
    import json

    theirs = tiny_moe(str(tmp_path / "moe"))
    if source == "folder":
        path = str(tmp_path / "moe")
        config_path = os.path.join(path, "config.json")
        with open(config_path) as f:
            config = json.load(f)
        config["num_local_experts"] = EXPERTS + 2
        with open(config_path, "w") as f:
            json.dump(config, f)
    else:
        path = str(tmp_path / "moe.gguf")
        write_gguf(theirs, path, "F32", expert_count=EXPERTS + 2)
    with pytest.raises(ModelLoadError, match=f"{EXPERTS + 2} experts but the weights hold {EXPERTS}"):
        exact_runner(load_model(path, default_cache_dir()))


def moe_config(**fields: Any) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        **MOE,
        **fields,
    }


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_experts_per_tok": 7}, "num_experts_per_tok 7 must be between 1 and num_experts \\(6\\)"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok 0"),
        ({"num_experts": -1}, "num_experts \\(-1\\)"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step must be at least 1"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size must be positive, not 0"),
        ({"mlp_only_layers": [4]}, "mlp_only_layers must list layer indices below 4"),
        ({"mlp_only_layers": 1}, "wrong type"),
    ],
)
def test_a_bad_moe_config_is_one_clear_error(fields: dict[str, Any], message: str) -> None:
    from kvserve.model.families import config_from_hf

    with pytest.raises(ValueError, match=message):
        config_from_hf(moe_config(**fields))


def test_the_sparse_layers_follow_transformers_rule() -> None:
    from kvserve.model.families import config_from_hf

    def sparse(**fields: Any) -> tuple[bool, ...]:
        moe = config_from_hf(moe_config(**fields)).moe
        assert moe is not None
        return moe.sparse_layers

    assert sparse() == (True, True, True, True)
    assert sparse(decoder_sparse_step=2, mlp_only_layers=[3]) == (False, True, False, False)
    assert sparse(num_experts=0) == (False, False, False, False)
    # transformers' save_pretrained writes the count as num_local_experts.
    raw = moe_config(num_local_experts=3, num_experts_per_tok=1)
    del raw["num_experts"]
    moe = config_from_hf(raw).moe
    assert moe is not None and moe.num_experts == 3


def test_the_engine_serves_transformers_greedy_reply_and_reads_it_back_from_its_cache(tmp_path: Any) -> None:
    """Through the scheduler, the paged KV and the prefix cache: a second request on the same prompt
    hits the first one's blocks and gives the same reply."""
    from kvserve import SamplingParams
    from kvserve.config import EngineConfig
    from kvserve.engine.engine import Engine

    path = str(tmp_path / "moe")
    theirs = tiny_moe(path)
    config = EngineConfig(
        kv_cache_memory=2**22, weight_dtype="float32", kv_dtype="float32", block_size=4, max_model_len=64
    )
    engine = Engine.from_config(config, model=load_model(path, default_cache_dir()))
    prompt = random_prompt(30, seed=6, vocab=theirs.config.vocab_size)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    replies = []
    for request_id in ("a", "b"):
        engine.add_request(request_id, prompt, params)
        tokens: list[int] = []
        cached = 0
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens += delta.token_ids
                cached = max(cached, delta.num_cached_tokens)
        replies.append((tokens, cached))
    (first, cached_first), (second, cached_second) = replies
    assert cached_first == 0 and cached_second >= 24 and second == first
    for layer in engine.runner.transformer.layers:
        assert isinstance(layer.mlp, SparseMoe)
    with torch.no_grad():
        expected = theirs.generate(
            torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False
        )
    assert first == expected[0, len(prompt) :].tolist()
