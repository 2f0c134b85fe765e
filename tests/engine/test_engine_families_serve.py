"""Each model family served by the engine (scheduler, paged KV, prefix cache): greedy replies are
transformers', and a second request on the same prompt reads the first one's cached KV and gives the
same reply."""

from typing import Any

import pytest
import torch

from kvserve import SamplingParams
from kvserve.config import EngineConfig, default_cache_dir
from kvserve.engine.engine import Engine
from kvserve.model.loader import load_model
from tests.helpers import save_tiny_model
from tests.model.family_cases import CASES, random_prompt


def _reply(engine: Engine, request_id: str, prompt: list[int], steps: int) -> tuple[list[int], int]:
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    engine.add_request(request_id, prompt, params)
    tokens: list[int] = []
    cached = 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens += delta.token_ids
            cached = max(cached, delta.num_cached_tokens)
    return tokens, cached


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_family_serves_transformers_greedy_replies_from_its_cache(tmp_path: Any, case: str) -> None:
    import transformers

    family, overrides = CASES[case]
    path = save_tiny_model(str(tmp_path / case), family, **overrides)
    config = EngineConfig(
        kv_cache_memory=2**22, weight_dtype="float32", kv_dtype="float32", block_size=4, max_model_len=64
    )
    engine = Engine.from_config(config, model=load_model(path, default_cache_dir()))
    prompt = random_prompt(30, seed=6)
    first, cached_first = _reply(engine, "a", prompt, 8)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        expected = theirs.generate(
            torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False
        )
    assert first == expected[0, len(prompt) :].tolist()
    second, cached_second = _reply(engine, "b", prompt, 8)
    assert cached_first == 0 and cached_second >= 24
    assert second == first
