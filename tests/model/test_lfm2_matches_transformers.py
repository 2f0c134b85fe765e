"""LFM2 (gated short convolutions beside attention) against transformers' Lfm2ForCausalLM on tiny random
weights in float32: logits at every prompt position and greedy tokens, with prompts longer than a
prefill chunk (chunks that resume from the convolution's state), several sequences side by side, and a
state shape that disagrees with the config refused at load."""

from typing import Any

import pytest
import torch

from kvserve.config import default_cache_dir
from kvserve.errors import ModelLoadError
from kvserve.model.loader import load_model
from kvserve.model.recurrent import StateShapeError
from kvserve.model.runner import ForwardBatch, ModelRunner, SequenceChunk
from tests.helpers import save_tiny_model
from tests.model.family_cases import hf_logits, random_prompt

# Conv, attention, conv, conv: a conv layer first and last, attention between.
LFM2: dict[str, Any] = {
    "num_hidden_layers": 4,
    "layer_types": ["conv", "full_attention", "conv", "conv"],
    "conv_L_cache": 3,
    "block_auto_adjust_ff_dim": True,
    "block_multiple_of": 32,
    "vocab_size": 512,
}


def _runner(model: Any) -> ModelRunner:
    return ModelRunner(model, 64, 4, 512, "cpu", "float32", "float32", kv_dtype="float32", num_state_slots=8)


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    import transformers

    folder = save_tiny_model(str(tmp_path_factory.mktemp("lfm2")), "lfm2", **LFM2)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    return load_model(folder, default_cache_dir()), theirs


def _run(
    runner: ModelRunner, prompts: list[list[int]], chunk: int, steps: int
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill the prompts side by side in chunks of `chunk` tokens (each chunk's logits kept), then
    decode `steps` greedy tokens together; each sequence in its own state slot and blocks."""
    tables = [list(range(16 * j, 16 * (j + 1))) for j in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    logits: torch.Tensor | None = None
    done = 0
    while done < max(len(p) for p in prompts):
        chunks = []
        live = []
        for j, p in enumerate(prompts):
            if done < len(p):
                part = p[done : done + chunk]
                chunks.append(
                    SequenceChunk(part, done, tables[j], done + chunk >= len(p), True, state_slot=j + 1)
                )
                live.append(j)
        out = runner.execute(ForwardBatch(prefills=chunks))
        for j, c in zip(live, out.chunks, strict=True):
            rows[j].append(c)
        done += chunk
    last = torch.stack([r[-1][-1] for r in rows])
    logits = last
    for _ in range(steps):
        for j, row in enumerate(logits):
            seqs[j].append(int(row.argmax()))
        decodes = [
            SequenceChunk(s[-1:], len(s) - 1, t, True, state_slot=j + 1)
            for j, (s, t) in enumerate(zip(seqs, tables, strict=True))
        ]
        logits = runner.execute(ForwardBatch(decodes=decodes)).sampled
        for j, row in enumerate(logits):
            rows[j].append(row.unsqueeze(0))
    return [torch.cat(r) for r in rows], [s[len(p) :] for s, p in zip(seqs, prompts, strict=True)]


@pytest.mark.parametrize("chunk", [5, 64])
def test_lfm2_matches_transformers(lfm2: tuple[Any, Any], chunk: int) -> None:
    ours, theirs = lfm2
    assert ours.config.hybrid and ours.config.attention_layers == (1,)
    runner = _runner(ours)
    assert runner.transformer.decoder is None
    prompts = [random_prompt(23, seed=1, vocab=512), random_prompt(11, seed=2, vocab=512)]
    logits, tokens = _run(runner, prompts, chunk, 6)
    for prompt, got, new in zip(prompts, logits, tokens, strict=True):
        expected = hf_logits(theirs, prompt + new)[: len(prompt) + 6]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        with torch.no_grad():
            greedy = theirs.generate(
                torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False
            )
        assert new == greedy[0, len(prompt) :].tolist()


def test_a_conv_width_other_than_the_config_is_refused(tmp_path: Any) -> None:
    import json
    import os

    folder = save_tiny_model(str(tmp_path / "m"), "lfm2", **LFM2)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["conv_L_cache"] = 4
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ModelLoadError, match="conv_L_cache"):
        _runner(load_model(folder, default_cache_dir()))


def test_a_state_of_another_shape_is_refused(lfm2: tuple[Any, Any]) -> None:
    runner = _runner(lfm2[0])
    assert runner.state is not None
    good = runner.state.read_slot(1)
    with pytest.raises(StateShapeError, match="config makes it"):
        runner.state.write_slot(1, [t[:, :1] for t in good])
    with pytest.raises(StateShapeError, match="tensors"):
        runner.state.write_slot(1, good[:-1])
    runner.state.write_slot(1, good)
