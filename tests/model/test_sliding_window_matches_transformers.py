"""Sliding-window attention at any length: prompts far longer than the window give transformers' logits
(float32, 1e-4) at every position and its greedy continuation, on both attention backends, for a model
whose every layer slides (Mistral) and one that mixes global and sliding layers (Qwen2's
max_window_layers), with windows inside one block, of exactly one block and of several blocks."""

from typing import Any

import pytest
import torch

from kvserve.config import default_cache_dir
from kvserve.model.loader import LoadedModel, load_model
from kvserve.model.runner import ForwardBatch, ModelRunner, SequenceChunk
from tests.helpers import save_tiny_model
from tests.model.family_cases import batched_greedy

BLOCK = 4

# name -> (family, config overrides, the layers' windows as kvserve reads them)
MODELS: dict[str, tuple[str, dict[str, Any], tuple[int | None, ...]]] = {
    # A window inside one block (3 < 4).
    "mistral-window-3": ("mistral", {"sliding_window": 3}, (3, 3)),
    # A window of exactly one block.
    "mistral-window-4": ("mistral", {"sliding_window": 4}, (4, 4)),
    # A window of one token: each token sees only itself.
    "mistral-window-1": ("mistral", {"sliding_window": 1}, (1, 1)),
    # Head size 64 takes the native kernel's vector path; a window of several blocks.
    "mistral-window-10-head-64": ("mistral", {"sliding_window": 10, "head_dim": 64}, (10, 10)),
    # Hybrid: layer 0 global, layers 1 and 2 slide over several blocks.
    "qwen2-hybrid-window-9": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 9, "max_window_layers": 1, "num_hidden_layers": 3},
        (None, 9, 9),
    ),
    "qwen2-hybrid-window-2-head-64": (
        "qwen2",
        {
            "use_sliding_window": True,
            "sliding_window": 2,
            "max_window_layers": 1,
            "num_hidden_layers": 2,
            "head_dim": 64,
        },
        (None, 2),
    ),
}

BACKENDS = ["torch", "native"]


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, Any]:
    import transformers

    family, overrides, windows = MODELS[request.param]
    path = save_tiny_model(str(tmp_path_factory.mktemp(request.param)), family, **overrides)
    ours = load_model(path, default_cache_dir())
    assert ours.config.windows == windows
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    return ours, theirs


def _runner(model: LoadedModel, backend: str) -> ModelRunner:
    return ModelRunner(model, 256, BLOCK, 512, "cpu", "float32", "float32", backend)


def _hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()  # type: ignore[no-any-return]


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_logits_at_every_position_match_transformers(
    pair: tuple[LoadedModel, Any], backend: str
) -> None:
    """One prefill of a prompt many windows long: every position's logits."""
    ours, theirs = pair
    runner = _runner(ours, backend)
    ids = _prompt(45, 1)
    chunk = SequenceChunk(ids, 0, list(range(12)), True, all_logits=True)
    got = runner.execute(ForwardBatch(prefills=[chunk])).chunks[0]
    torch.testing.assert_close(got, _hf_logits(theirs, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunks_after_cached_context_match_transformers(pair: tuple[LoadedModel, Any], backend: str) -> None:
    """The path a prefix-cache hit takes: chunks of odd sizes, each reading the context before it, the
    window crossing chunk and block bounds."""
    ours, theirs = pair
    runner = _runner(ours, backend)
    ids = _prompt(47, 3)
    expected = _hf_logits(theirs, ids)
    table = list(range(20, 32))
    start = 0
    for size in (5, 1, 7, 3, 16, 15):
        chunk = SequenceChunk(ids[start : start + size], start, table, True, all_logits=True)
        got = runner.execute(ForwardBatch(prefills=[chunk])).chunks[0]
        torch.testing.assert_close(got, expected[start : start + size], atol=1e-4, rtol=1e-4)
        start += size
    assert start == len(ids)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_greedy_decodes_match_transformers(pair: tuple[LoadedModel, Any], backend: str) -> None:
    """Prompts shorter and longer than the window prefilled together, then decoded together: each
    step's logits, and each whole greedy continuation, are transformers'."""
    ours, theirs = pair
    runner = _runner(ours, backend)
    prompts = [_prompt(n, 10 + n) for n in (2, 9, 30, 41)]
    tables = [list(range(50 + 16 * i, 50 + 16 * (i + 1))) for i in range(len(prompts))]
    steps = 8
    seqs = batched_greedy(runner, theirs, prompts, tables, steps)
    for prompt, seq in zip(prompts, seqs, strict=True):
        expected = _hf_logits(theirs, seq[:-1])[len(prompt) - 1 :]
        # transformers' greedy choice after each of these prefixes: by induction, its whole greedy
        # continuation. (Its own generate with a cache differs from its forward pass at window 1.)
        assert seq[len(prompt) :] == expected.argmax(-1).tolist()


def test_a_sliding_model_decodes_through_the_native_decoder_with_the_per_op_bits(
    pair: tuple[LoadedModel, Any],
) -> None:
    """The one-call native decoder passes each layer's window: decodes far past it give the per-op
    path's logits and K/V bit for bit."""
    ours, _ = pair
    runner = ModelRunner(ours, 32, BLOCK, 64, "cpu", "float32", "q8_0", "native")
    decoder = runner.transformer.decoder
    assert decoder is not None
    prompts = [_prompt(n, 20 + n) for n in (3, 27, 40)]
    tables = [list(range(10 * i, 10 * (i + 1))) for i in range(len(prompts))]
    for prompt, table in zip(prompts, tables, strict=True):
        runner.execute(ForwardBatch(prefills=[SequenceChunk(prompt[:-1], 0, table, False)]))
    step = ForwardBatch(
        decodes=[SequenceChunk(p[-1:], len(p) - 1, t, True) for p, t in zip(prompts, tables, strict=True)]
    )
    kv = runner.kv_cache
    before = [c.clone() for c in (kv.k, kv.v, kv.sliding_k, kv.sliding_v)]
    fused = runner.execute(step).sampled
    written = [c.clone() for c in (kv.k, kv.v, kv.sliding_k, kv.sliding_v)]
    for cache, old in zip((kv.k, kv.v, kv.sliding_k, kv.sliding_v), before, strict=True):
        cache.copy_(old)
    runner.transformer.decoder = None
    assert torch.equal(runner.execute(step).sampled, fused)
    for cache, expected in zip((kv.k, kv.v, kv.sliding_k, kv.sliding_v), written, strict=True):
        assert torch.equal(cache, expected)


def test_a_tokens_logits_are_bitwise_the_same_from_a_prefill_a_chunk_or_a_decode(
    pair: tuple[LoadedModel, Any],
) -> None:
    """With row-invariant products and the native kernel, a windowed row is the same row whether its
    token ended a whole prefill, a chunk after cached context or came as a decode: the window keeps the
    kernel's bitwise batch invariance."""
    ours, _ = pair
    runner = ModelRunner(ours, 64, BLOCK, 128, "cpu", "float32", "float16", "native")
    prompt = _prompt(41, 8)
    tables = [list(range(16 * i, 16 * (i + 1))) for i in range(3)]
    whole = runner.execute(ForwardBatch(prefills=[SequenceChunk(prompt, 0, tables[0], True)])).sampled[0]
    runner.execute(ForwardBatch(prefills=[SequenceChunk(prompt[:-1], 0, tables[1], False)]))
    decode = SequenceChunk(prompt[-1:], 40, tables[1], True)
    decoded = runner.execute(ForwardBatch(decodes=[decode])).sampled[0]
    runner.execute(ForwardBatch(prefills=[SequenceChunk(prompt[:25], 0, tables[2], False)]))
    chunk = SequenceChunk(prompt[25:], 25, tables[2], True)
    chunked = runner.execute(ForwardBatch(prefills=[chunk])).sampled[0]
    assert torch.equal(decoded, whole)
    assert torch.equal(chunked, whole)
