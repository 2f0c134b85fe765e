"""Every family beyond Llama against transformers' own classes on tiny random float32 weights saved as a
Hugging Face folder: logits at every prompt position and at every greedy step equal transformers' to
1e-4, and the greedy continuation is transformers' token for token."""

from typing import Any

import pytest
import torch

from kvserve.config import default_cache_dir
from kvserve.model.loader import load_model
from kvserve.model.runner import ForwardBatch, ModelRunner, SequenceChunk
from tests.helpers import save_tiny_model
from tests.model.family_cases import CASES, exact_runner, hf_logits, prompt_and_greedy, random_prompt


def _transformers(path: str) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]


def _greedy(model: Any, prompt: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps
        )
    return out[0, len(prompt) :].tolist()  # type: ignore[no-any-return]


@pytest.mark.parametrize("case", sorted(CASES))
def test_prompt_logits_and_greedy_tokens_match_transformers(tmp_path: Any, case: str) -> None:
    family, overrides = CASES[case]
    path = save_tiny_model(str(tmp_path / case), family, **overrides)
    ours = load_model(path, default_cache_dir())
    assert ours.config.architecture == family
    theirs = _transformers(path)
    prompt = random_prompt(37, seed=1)
    # Phi-3's served context stays within its pretraining length here: the short factors, as transformers
    # takes them for a sequence this long.
    runner = exact_runner(ours, max_positions=64 if family == "phi3" else 512)
    logits, tokens = prompt_and_greedy(runner, prompt, 6)
    assert tokens == _greedy(theirs, prompt, 6)
    expected = hf_logits(theirs, prompt + tokens)[: len(prompt) + 6]
    error = (logits - expected).abs().max().item()
    print(f"{case}: max abs logit error {error:.2e}")
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_phi3_takes_the_long_factors_past_its_pretraining_length(tmp_path: Any) -> None:
    """A served context past original_max_position_embeddings rotates by the long factors: the logits
    of a prompt past that length are transformers' (which takes the long factors for it)."""
    family, overrides = CASES["phi3-longrope"]
    path = save_tiny_model(str(tmp_path / "phi3"), family, **overrides)
    ours = load_model(path, default_cache_dir())
    theirs = _transformers(path)
    prompt = random_prompt(70, seed=2)
    logits, tokens = prompt_and_greedy(exact_runner(ours, max_positions=512), prompt, 4)
    torch.testing.assert_close(
        logits, hf_logits(theirs, prompt + tokens)[: len(prompt) + 4], atol=1e-4, rtol=1e-4
    )
    # The short factors give other logits: the test tells the two apart.
    short, _ = prompt_and_greedy(exact_runner(ours, max_positions=64), prompt[:60], 0)
    assert not torch.allclose(short, logits[:60], atol=1e-3)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_layer_kind_decodes_through_the_native_decoder_as_a_prefill_would(
    tmp_path: Any, case: str
) -> None:
    """With native products and attention, every case (q/k norms, NoPE, partial rotary, post norms,
    GeGLU, local rope) decodes through the native decoder and gives a prefill's logits at the same
    position (tests/model/test_native_decoder_matches_per_op.py checks the per-op path's bits)."""
    family, overrides = CASES[case]
    ours = load_model(save_tiny_model(str(tmp_path / case), family, **overrides), default_cache_dir())
    runner = ModelRunner(ours, 32, 4, 64, "cpu", "float32", "q8_0", "native")
    assert runner.transformer.decoder is not None
    prompt = random_prompt(21, seed=4)
    table = list(range(8))
    runner.execute(ForwardBatch(prefills=[SequenceChunk(prompt[:-1], 0, table, False)]))
    decode = runner.execute(ForwardBatch(decodes=[SequenceChunk(prompt[-1:], 20, table, True)])).sampled[0]
    whole = runner.execute(
        ForwardBatch(prefills=[SequenceChunk(prompt, 0, list(range(8, 16)), True)])
    ).sampled
    torch.testing.assert_close(decode, whole[0], atol=1e-5, rtol=1e-5)


def test_a_llama_shaped_phi3_decodes_through_the_native_decoder_with_the_per_op_bits(tmp_path: Any) -> None:
    """Phi-3 with full rotary and no scaling is Llama-shaped once its fused products are split: the native
    decoder serves it, with the per-op path's bits."""
    path = save_tiny_model(str(tmp_path / "phi3"), "phi3", tie_word_embeddings=False)
    runner = ModelRunner(load_model(path, default_cache_dir()), 32, 4, 64, "cpu", "float32", "q8_0", "native")
    assert runner.transformer.decoder is not None
    prompt = random_prompt(21, seed=5)
    table = list(range(8))
    runner.execute(ForwardBatch(prefills=[SequenceChunk(prompt[:-1], 0, table, False)]))
    step = ForwardBatch(decodes=[SequenceChunk(prompt[-1:], 20, table, True)])
    k, v = runner.kv_cache.k.clone(), runner.kv_cache.v.clone()
    fused = runner.execute(step).sampled
    runner.kv_cache.k.copy_(k)
    runner.kv_cache.v.copy_(v)
    runner.transformer.decoder = None
    assert torch.equal(runner.execute(step).sampled, fused)
