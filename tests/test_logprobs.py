"""Logprobs and prompt logprobs against transformers, offline (vLLM's shapes) and through the server
(the legacy completions shape with echo), on a tiny random Llama with float32 weights."""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import openai
import pytest
import torch
from fastapi import FastAPI

from kvserve.config import EngineConfig, default_cache_dir
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.llm import LLM
from kvserve.model.loader import load_model
from kvserve.options import ServerOptions
from kvserve.server.app import create_app
from tests.harness import assert_no_leak
from tests.helpers import save_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

# float32 weights and KV: logprobs are compared with transformers' float32 to 1e-4.
CONFIG: dict[str, Any] = {
    "weight_dtype": "float32",
    "kv_dtype": "float32",
    "block_size": 4,
    "kv_cache_memory": 2**22,
    "max_model_len": 256,
}
PROMPT = torch.randint(100, 4096, (29,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny") / "llama"), "llama", vocab_size=4096)


@pytest.fixture(scope="module")
def hf_logprobs(tiny_path: str) -> Callable[[list[int]], torch.Tensor]:
    """transformers' log_softmax at every position of a token sequence: row p scores token p + 1."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)

    return logprobs


@pytest.fixture(scope="module")
def llm(tiny_path: str) -> LLM:
    return LLM(tiny_path, **CONFIG)


def test_offline_logprobs_equal_transformers_cached_prefix_or_not(
    llm: LLM, hf_logprobs: Callable[[list[int]], torch.Tensor]
) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    for attempt in range(2):
        # The second time the prompt is in the prefix cache: its logits are still computed.
        (out,) = llm.generate({"prompt_token_ids": PROMPT}, params)
        completion = out.outputs[0]
        ids = PROMPT + completion.token_ids
        expected = hf_logprobs(ids)
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(PROMPT)
        for p in range(1, len(PROMPT)):
            position = out.prompt_logprobs[p]
            assert position is not None
            assert abs(position[PROMPT[p]].logprob - expected[p - 1, PROMPT[p]].item()) < 1e-4, (attempt, p)
        assert completion.logprobs is not None and len(completion.logprobs) == 6
        for j, position in enumerate(completion.logprobs):
            token = completion.token_ids[j]
            row = expected[len(PROMPT) - 1 + j]
            assert abs(position[token].logprob - row[token].item()) < 1e-4
            # Greedy: the sampled token is the most likely one, and the top list is the asked size.
            top = sorted(
                (lp for t, lp in position.items() if lp.rank is not None and lp.rank <= 3),
                key=lambda x: x.rank or 0,
            )
            assert [lp.rank for lp in top] == [1, 2, 3]
            assert position[token].rank == 1 and position[token].logprob == top[0].logprob
            assert [lp.logprob for lp in top] == sorted((lp.logprob for lp in top), reverse=True)
            torch.testing.assert_close(
                torch.tensor([lp.logprob for lp in top]), row.topk(3).values, atol=1e-4, rtol=0
            )
    assert_no_leak(llm.engine)


def test_generated_logprobs_after_a_cached_prefix_equal_transformers(
    llm: LLM, hf_logprobs: Callable[[list[int]], torch.Tensor]
) -> None:
    llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, temperature=0.0))
    prompt = [*PROMPT, 300, 301, 302]
    (out,) = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(max_tokens=5, temperature=0.0, logprobs=0, ignore_eos=True),
    )
    assert out.num_cached_tokens >= 28
    expected = hf_logprobs(prompt + out.outputs[0].token_ids)
    assert out.outputs[0].logprobs is not None
    for j, (token, position) in enumerate(
        zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)
    ):
        assert len(position) == 1
        assert abs(position[token].logprob - expected[len(prompt) - 1 + j, token].item()) < 1e-4


def test_prompt_logprobs_only_and_per_prompt_params(llm: LLM) -> None:
    """max_tokens=0 scores the prompt and generates nothing; a list of SamplingParams is one per prompt."""
    outs = llm.generate(
        [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:10]}],
        [
            SamplingParams(max_tokens=0, prompt_logprobs=0),
            SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
        ],
    )
    assert outs[0].outputs[0].token_ids == [] and outs[0].outputs[0].finish_reason == "length"
    assert outs[0].prompt_logprobs is not None and len(outs[0].prompt_logprobs) == len(PROMPT)
    assert len(outs[1].outputs[0].token_ids) == 3 and outs[1].prompt_logprobs is None


@pytest.fixture(scope="module")
def client(
    tiny_path: str, serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[openai.OpenAI]:
    engine = Engine(EngineConfig(**CONFIG), model=load_model(tiny_path, default_cache_dir()))
    with serve_app(create_app(AsyncEngine(engine), ServerOptions())) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_logprobs_through_the_server_equal_transformers(
    client: openai.OpenAI, hf_logprobs: Callable[[list[int]], torch.Tensor], stream: bool
) -> None:
    """What evaluation harnesses send: token ids, echo, logprobs, and max_tokens 0 or more."""
    for max_tokens in (0, 4):
        kwargs: dict[str, Any] = {
            "model": "",
            "prompt": PROMPT,
            "echo": True,
            "logprobs": 2,
            "max_tokens": max_tokens,
            "temperature": 0.0,
        }
        if stream:
            chunks = list(client.completions.create(stream=True, **kwargs))
            tokens = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens or []]
            values = [
                v for c in chunks for ch in c.choices if ch.logprobs for v in ch.logprobs.token_logprobs or []
            ]
            tops = [
                t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.top_logprobs or []
            ]
        else:
            choice = client.completions.create(**kwargs).choices[0]
            assert choice.logprobs is not None
            tokens, values, tops = (
                choice.logprobs.tokens or [],
                choice.logprobs.token_logprobs or [],
                choice.logprobs.top_logprobs or [],
            )
        assert len(tokens) == len(values) == len(tops) == len(PROMPT) + max_tokens
        assert values[0] is None and tops[0] is None
        expected = hf_logprobs(PROMPT)
        got = torch.tensor(values[1 : len(PROMPT)])
        want = expected[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        assert all(t is not None and len(t) <= 2 for t in tops[1:])
