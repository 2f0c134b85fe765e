"""Qwen3-Next on transformers' own class (tiny random weights, float32): its fused DeltaNet projections
(`in_proj_qkvz`, `in_proj_ba`, interleaved by key head) read as Qwen3.5's four, its sparse MoE with a
shared expert beside a dense `mlp_only_layers` layer; logits at every position of a prompt longer than
the DeltaNet's chunk (prefilled in chunks resuming from the state), and greedy tokens decoded from the
state, equal transformers'."""

from typing import Any

import torch

from kvserve.config import default_cache_dir
from kvserve.model.loader import load_model
from kvserve.model.mlp import GatedMlp
from kvserve.model.runner import ForwardBatch, ModelRunner, SequenceChunk
from kvserve.model.shared_expert import SharedExpertMoe
from tests.helpers import save_tiny_model
from tests.model.family_cases import hf_logits, random_prompt

QWEN3_NEXT: dict[str, Any] = {
    "num_hidden_layers": 3,
    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 6,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 24,
    "mlp_only_layers": [2],
    "vocab_size": 4096,
}


def _greedy(runner: ModelRunner, prompt: list[int], chunk: int, steps: int) -> tuple[torch.Tensor, list[int]]:
    """Logits of every prompt position (prefilled in chunks) and of `steps` greedy decodes, and the
    tokens; the sequence in state slot 1."""
    table = list(range(64))
    rows = []
    for done in range(0, len(prompt), chunk):
        last = done + chunk >= len(prompt)
        piece = SequenceChunk(prompt[done : done + chunk], done, table, last, True, state_slot=1)
        rows.append(runner.execute(ForwardBatch(prefills=[piece])).chunks[0])
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(rows[-1][-1].argmax()))
        step = SequenceChunk(ids[-1:], len(ids) - 1, table, True, state_slot=1)
        rows.append(runner.execute(ForwardBatch(decodes=[step])).sampled)
    return torch.cat(rows)[: len(ids)], ids[len(prompt) :]


def test_qwen3_next_matches_transformers(tmp_path: Any) -> None:
    import transformers

    folder = save_tiny_model(str(tmp_path / "next"), "qwen3_next", **QWEN3_NEXT)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    ours = load_model(folder, default_cache_dir())
    assert ours.config.architecture == "qwen3_next"
    runner = ModelRunner(ours, 64, 4, 512, "cpu", "float32", "float32", kv_dtype="float32", num_state_slots=4)
    mlps = [layer.mlp for layer in runner.transformer.layers]
    assert isinstance(mlps[0], SharedExpertMoe) and isinstance(mlps[2], GatedMlp)
    prompt = random_prompt(150, seed=5, vocab=QWEN3_NEXT["vocab_size"])
    logits, tokens = _greedy(runner, prompt, 96, 6)
    expected = hf_logits(theirs, prompt + tokens)[: len(prompt) + 6]
    print(f"qwen3_next: max abs logit error {(logits - expected).abs().max():.2e}")
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        greedy = theirs.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert tokens == greedy[0, len(prompt) :].tolist()
