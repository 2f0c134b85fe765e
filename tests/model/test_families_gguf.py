"""Every family from a GGUF written in llama.cpp's tensor and metadata names: as F32, its logits at every
prompt position and greedy tokens are transformers' on the same weights; as Q8_0 with Q6_K down
projections, every product runs natively on the file's blocks and the logits are transformers' on the
dequantized weights."""

from typing import Any

import pytest
import torch

from kvserve.model.loader import load_model
from kvserve.model.quant_blocks import Q6_K, Q8_0
from kvserve.model.quant_linear import QuantLinear
from tests.helpers import save_tiny_model
from tests.model.family_cases import (
    CASES,
    exact_runner,
    gguf_case,
    hf_logits,
    prompt_and_greedy,
    random_prompt,
)
from tests.model.gguf_families import write_family_gguf


@pytest.mark.parametrize("quantized", [False, True], ids=["F32", "Q8_0+Q6_K"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_gguf_of_each_family_matches_transformers(tmp_path: Any, case: str, quantized: bool) -> None:
    import transformers

    family, overrides = gguf_case(case)
    folder = save_tiny_model(str(tmp_path / case), family, **overrides)
    path = str(tmp_path / f"{case}.gguf")
    reference = write_family_gguf(folder, path, family, quantized)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    missing, unexpected = theirs.load_state_dict(reference, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing)
    ours = load_model(path, str(tmp_path / "cache"))
    assert ours.config.architecture == family
    text = "Hello world, how are you?"
    ids = ours.tokenizer.encode(text)
    assert len(ids) < len(text) and ours.tokenizer.decode(ids) == text
    runner = exact_runner(ours, 64 if family == "phi3" else 512, "gguf" if quantized else "float32")
    transformer = runner.transformer
    if quantized:
        for layer in transformer.layers:
            for product in (layer.qkv, layer.o, layer.gate, layer.up, layer.down):
                assert isinstance(product, QuantLinear)
            assert isinstance(layer.down, QuantLinear) and layer.down.weight.qtype == Q6_K
        assert isinstance(transformer.lm_head, QuantLinear) and transformer.lm_head.weight.qtype == Q8_0
    prompt = random_prompt(37, seed=3, vocab=overrides["vocab_size"])
    logits, tokens = prompt_and_greedy(runner, prompt, 6)
    expected = hf_logits(theirs, prompt + tokens)[: len(prompt) + 6]
    kind = "quantized" if quantized else "F32"
    print(f"{case} {kind}: max abs logit error {(logits - expected).abs().max():.2e}")
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        greedy = theirs.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert tokens == greedy[0, len(prompt) :].tolist()


# Llama 3's scaling at a tiny head_dim (8 rotated pairs). "small": base 10000 and a pretraining context
# of 32, so that the first pair keeps its frequency, the second is smoothed and the other six are divided
# by 8: not Meta's parameters, so served as the file's divisors. "meta": Llama 3.x's own parameters
# (pretraining context 8192) at base 500000, one pair in the smoothed band: served as the llama3 scaling.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3_CASES = {"small": (10000.0, 32), "meta": (500000.0, 8192)}


@pytest.mark.parametrize("case", sorted(LLAMA3_CASES))
def test_a_llama3_gguf_keeps_its_rope_scaling(tmp_path: Any, case: str) -> None:
    """Llama 3.x as llama.cpp's converter writes it: the scaling as a rope_freqs tensor, no rope metadata.
    The logits past the pretraining context are transformers' on the checkpoint with its rope_scaling
    (transformers' own GGUF reader drops the tensor, so the reference is the safetensors model)."""
    import transformers

    from kvserve.model.rope import inverse_frequencies
    from tests.model.gguf_families import save_tiny_llama

    theta, context = LLAMA3_CASES[case]
    folder = save_tiny_llama(
        str(tmp_path / "llama3"),
        rope_theta=theta,
        rope_scaling={**LLAMA3_ROPE, "rope_theta": theta, "original_max_position_embeddings": context},
        # Where llama.cpp's converter reads the pretraining context.
        original_max_position_embeddings=context,
    )
    path = str(tmp_path / "llama3.gguf")
    write_family_gguf(folder, path, "llama", False)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    assert theirs.config.rope_parameters["rope_type"] == "llama3"
    ours = load_model(path, str(tmp_path / "cache"))
    c = ours.config
    if case == "small":
        factors = c.rope_freq_factors
        assert factors[0] == 1.0 and 1.0 < factors[1] < 8.0 and factors[2:] == (8.0,) * 6
    else:
        assert c.rope_freq_factors == () and c.rope_scaling_dict["rope_type"] == "llama3"
        # Transformers' frequencies bit for bit, which the stored divisors would miss by an ulp.
        assert torch.equal(inverse_frequencies(c, 512)[0], theirs.model.rotary_emb.inv_freq)
    runner = exact_runner(ours, 512)
    prompt = random_prompt(2 * 32 + 7, seed=5, vocab=ours.config.vocab_size)
    logits, tokens = prompt_and_greedy(runner, prompt, 6)
    expected = hf_logits(theirs, prompt + tokens)[: len(prompt) + 6]
    print(f"llama3 rope {case}: max abs logit error {(logits - expected).abs().max():.2e}")
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


# YaRN as llama.cpp's converter writes it for Qwen: `{arch}.rope.scaling.type` yarn, its factor and the
# pretraining context (here 32 tokens, so that the prompt runs past it), and llama.cpp's attn_factor (a
# multiplier of YaRN's magnitude correction 1 + 0.1 ln(factor), which transformers' attention_factor
# replaces) where the case has one.
YARN_CASES = {"plain": None, "attn-factor": 0.8}


@pytest.mark.parametrize("case", sorted(YARN_CASES))
def test_a_qwen3_gguf_keeps_its_yarn_scaling(tmp_path: Any, case: str) -> None:
    import math

    import gguf
    import transformers

    attn_factor = YARN_CASES[case]
    factor, context = 4.0, 32
    family, overrides = gguf_case("qwen3")
    yarn: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": context,
    }
    if attn_factor is not None:
        yarn["attention_factor"] = attn_factor * (1 + 0.1 * math.log(factor))
    folder = save_tiny_model(
        str(tmp_path / "qwen3"), family, **overrides, rope_scaling={**yarn, "rope_theta": 1e4}
    )

    def metadata(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(context)
        if attn_factor is not None:
            writer.add_rope_scaling_attn_factors(attn_factor)

    path = str(tmp_path / "qwen3.gguf")
    write_family_gguf(folder, path, family, False, extra=metadata)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    assert theirs.config.rope_parameters["rope_type"] == "yarn"
    ours = load_model(path, str(tmp_path / "cache"))
    assert ours.config.rope_scaling_dict["rope_type"] == "yarn"
    prompt = random_prompt(3 * context + 5, seed=7, vocab=overrides["vocab_size"])
    logits, tokens = prompt_and_greedy(exact_runner(ours, 512), prompt, 6)
    expected = hf_logits(theirs, prompt + tokens)[: len(prompt) + 6]
    print(f"qwen3 yarn {case}: max abs logit error {(logits - expected).abs().max():.2e}")
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
