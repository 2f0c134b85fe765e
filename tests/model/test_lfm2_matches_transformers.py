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


@pytest.mark.parametrize("quantized", [False, True], ids=["F32", "Q8_0"])
def test_an_lfm2_gguf_matches_transformers(tmp_path: Any, quantized: bool) -> None:
    """llama.cpp's "lfm2" layout (per-layer KV head counts, `shortconv.*` tensors, the conv as [hidden,
    L], `token_embd_norm` as the final norm) loads and matches transformers on the file's values; Q8_0
    products run natively on the file's blocks, the conv layers' in_proj and out_proj included."""
    import transformers

    from kvserve.model.quant_linear import QuantLinear
    from kvserve.model.short_conv import ShortConv
    from tests.model.gguf_families import tiny_vocabulary, write_family_gguf

    vocabulary = tiny_vocabulary("lfm2")
    overrides = {
        **LFM2,
        "block_auto_adjust_ff_dim": False,
        "intermediate_size": 256,
        "vocab_size": len(vocabulary),
        "bos_token_id": vocabulary.bos,
        "eos_token_id": vocabulary.eos,
        "pad_token_id": vocabulary.eos,
    }
    folder = save_tiny_model(str(tmp_path / "lfm2"), "lfm2", **overrides)
    path = str(tmp_path / "lfm2.gguf")
    reference = write_family_gguf(folder, path, "lfm2", quantized)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    missing, unexpected = theirs.load_state_dict(reference, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing)
    ours = load_model(path, str(tmp_path / "cache"))
    assert ours.config.architecture == "lfm2" and ours.config.attention_layers == (1,)
    runner = ModelRunner(
        ours,
        64,
        4,
        512,
        "cpu",
        "float32",
        "gguf" if quantized else "float32",
        kv_dtype="float32",
        num_state_slots=4,
    )
    conv = runner.transformer.layers[0].mixer
    assert isinstance(conv, ShortConv)
    if quantized:
        assert isinstance(conv.in_proj, QuantLinear) and isinstance(conv.out_proj, QuantLinear)
    # Where the products and norms are native the one-call decoder serves the decodes.
    assert (runner.transformer.decoder is not None) == quantized
    prompt = random_prompt(37, seed=3, vocab=len(vocabulary))
    logits, tokens = _run(runner, [prompt], 16, 6)
    expected = hf_logits(theirs, prompt + tokens[0])[: len(prompt) + 6]
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        greedy = theirs.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert tokens[0] == greedy[0, len(prompt) :].tolist()


def test_a_mixer_whose_state_disagrees_with_the_config_is_refused(
    lfm2: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvserve.model import runner as runner_module
    from kvserve.model.recurrent import StateSpec

    def wrong(config: Any, dtype: torch.dtype) -> list[StateSpec | None]:
        return [
            None if config.mixer(i) == "attention" else StateSpec(((7, 2),), dtype)
            for i in range(config.num_layers)
        ]

    monkeypatch.setattr(runner_module, "state_specs", wrong)
    with pytest.raises(ModelLoadError, match="disagrees with its config"):
        _runner(lfm2[0])


class _Meta:
    """GGUF metadata as the families read it (GgufMetadata's calls), from a dict."""

    arch = "lfm2"

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key.replace("{arch}", "lfm2"), default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"the GGUF metadata lacks {key}")
        return value

    def count(self, key: str) -> int | None:
        return None

    def has_tensor(self, name: str) -> bool:
        return False


_GOOD = {
    "lfm2.attention.head_count": 4,
    "lfm2.attention.head_count_kv": [0, 2, 0, 0],
    "lfm2.embedding_length": 64,
    "lfm2.feed_forward_length": 128,
    "lfm2.block_count": 4,
    "lfm2.vocab_size": 512,
    "lfm2.shortconv.l_cache": 3,
}


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({}, None),
        ({"lfm2.attention.head_count_kv": [0, 2, 0]}, "each of the 4 layers"),
        ({"lfm2.attention.head_count_kv": [0, 2, 0, 4]}, "one positive count"),
        ({"lfm2.attention.head_count_kv": [0, 0, 0, 0]}, "one positive count"),
        ({"lfm2.attention.head_count_kv": [0, "2", 0, 0]}, "must be an integer"),
        ({"lfm2.shortconv.l_cache": None}, "lacks"),
        ({"lfm2.shortconv.l_cache": 1}, "conv_L_cache must be 2 to 64"),
        ({"lfm2.shortconv.l_cache": 1 << 30}, "conv_L_cache must be 2 to 64"),
    ],
)
def test_hostile_lfm2_gguf_metadata_is_one_clear_error(change: dict[str, Any], error: str | None) -> None:
    from kvserve.model.families import config_from_hf
    from kvserve.model.families.lfm2 import LFM2

    assert LFM2.gguf_config is not None
    values = {k: v for k, v in {**_GOOD, **change}.items() if v is not None}
    if error is None:
        config = config_from_hf(LFM2.gguf_config(_Meta(values)))  # type: ignore[arg-type]
        assert config.mixers == ("short_conv", "attention", "short_conv", "short_conv")
        assert (config.num_kv_heads, config.conv_kernel, config.intermediate_size) == (2, 3, 128)
        return
    with pytest.raises(ValueError, match=error):
        config_from_hf(LFM2.gguf_config(_Meta(values)))  # type: ignore[arg-type]
