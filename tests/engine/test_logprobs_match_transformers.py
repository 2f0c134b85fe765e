"""Logprobs and prompt logprobs against transformers, offline (vLLM's shapes) and through the server
(the legacy completions shape: echoed prompts, generated tokens with their text offsets, and the raw
logprobs under temperature, penalties and logit_bias), on a tiny random Llama with float32 weights and
a float32 KV cache, so that the comparison holds to 1e-4."""

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

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()  # type: ignore[no-untyped-call]

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)  # type: ignore[no-any-return]

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
    engine = Engine.from_config(EngineConfig(**CONFIG), model=load_model(tiny_path, default_cache_dir()))
    with serve_app(create_app(AsyncEngine(engine), ServerOptions())) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_logprobs_through_the_server_equal_transformers(
    client: openai.OpenAI, hf_logprobs: Callable[[list[int]], torch.Tensor], hf_tokenizer: Any, stream: bool
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
        # Every scored position lists the two asked alternatives, transformers' top two.
        for p, top in enumerate(tops[1 : len(PROMPT)], start=1):
            assert top is not None
            assert_top_equals(top, _expected_top(hf_tokenizer, expected[p - 1], 2))


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_path: str) -> Any:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(tiny_path)


def _legacy_logprobs(
    client: openai.OpenAI, stream: bool, **kwargs: Any
) -> tuple[str, list[str], list[float], list[dict[str, float]], list[int]]:
    """text, tokens, token_logprobs, top_logprobs and text_offset of one completion, whole or streamed."""
    chunks = (
        list(client.completions.create(stream=True, **kwargs))
        if stream
        else [client.completions.create(**kwargs)]
    )
    choices = [ch for c in chunks for ch in c.choices]
    text = "".join(ch.text for ch in choices)
    pieces = [ch.logprobs for ch in choices if ch.logprobs is not None]
    tokens = [t for lp in pieces for t in lp.tokens or []]
    values = [v for lp in pieces for v in lp.token_logprobs or []]
    tops = [t for lp in pieces for t in lp.top_logprobs or []]
    offsets = [o for lp in pieces for o in lp.text_offset or []]
    assert None not in values and None not in tops
    return text, tokens, values, tops, offsets


def _resolve_ids(
    tokenizer: Any,
    prompt: list[int],
    tokens: list[str],
    values: list[float],
    hf: Callable[[list[int]], torch.Tensor],
) -> list[int]:
    """The ids of generated tokens known by their text and logprob: among the ids with that text, the one
    whose transformers logprob at that position matches (exactly one must)."""
    by_text: dict[str, list[int]] = {}
    for token_id in range(4096):
        by_text.setdefault(tokenizer.decode([token_id]), []).append(token_id)
    ids: list[int] = []
    for token, value in zip(tokens, values, strict=True):
        row = hf(prompt + ids)[-1]
        matches = [t for t in by_text.get(token, []) if abs(row[t].item() - value) < 1e-4]
        assert len(matches) == 1, f"no one token {token!r} has the raw logprob {value} at {len(ids)}"
        ids.append(matches[0])
    return ids


def _expected_top(tokenizer: Any, row: torch.Tensor, k: int) -> dict[str, float]:
    """The legacy top_logprobs of one position: token text -> logprob of transformers' top k. Tokens can
    share a text (pieces of one UTF-8 character, each shown as U+FFFD): the likeliest one stands for it."""
    top: dict[str, float] = {}
    values, ids = row.topk(k)
    for token_id, value in zip(ids.tolist(), values.tolist(), strict=True):
        top.setdefault(tokenizer.decode([token_id]), value)
    return top


def assert_top_equals(got: dict[str, float], want: dict[str, float]) -> None:
    assert got.keys() == want.keys()
    for text, value in want.items():
        assert abs(got[text] - value) < 1e-4, (text, got, want)


@pytest.mark.parametrize("stream", [False, True])
def test_generated_logprobs_and_text_offset_through_the_server_equal_transformers(
    client: openai.OpenAI, hf_logprobs: Callable[[list[int]], torch.Tensor], hf_tokenizer: Any, stream: bool
) -> None:
    """Without echo: each generated token's logprob, its top 3 and its character offset in the text, against
    transformers' greedy continuation on the same float32 weights (float32 KV: the same sums to 1e-4)."""
    ids = list(PROMPT)
    for _ in range(6):
        ids.append(int(hf_logprobs(ids)[-1].argmax()))
    generated = ids[len(PROMPT) :]
    expected = hf_logprobs(ids)
    kwargs: dict[str, Any] = {
        "model": "",
        "prompt": PROMPT,
        "logprobs": 3,
        "max_tokens": 6,
        "temperature": 0.0,
    }
    text, tokens, values, tops, offsets = _legacy_logprobs(
        client, stream, extra_body={"ignore_eos": True}, **kwargs
    )
    assert text == hf_tokenizer.decode(generated)
    assert tokens == [hf_tokenizer.decode([t]) for t in generated]
    assert offsets == [len(hf_tokenizer.decode(generated[:j])) for j in range(len(generated))]
    assert all(text[o : o + len(t)] == t for o, t in zip(offsets, tokens, strict=True))
    rows = expected[len(PROMPT) - 1 : -1]
    want = rows[torch.arange(len(generated)), torch.tensor(generated)]
    torch.testing.assert_close(torch.tensor(values), want, atol=1e-4, rtol=0)
    for top, row in zip(tops, rows, strict=True):
        assert_top_equals(top, _expected_top(hf_tokenizer, row, 3))


def test_logprobs_are_raw_under_temperature_penalties_and_logit_bias(
    client: openai.OpenAI, hf_logprobs: Callable[[list[int]], torch.Tensor], hf_tokenizer: Any
) -> None:
    """The README's claim: logprobs are the model's distribution before temperature, the three penalties,
    logit_bias and min_tokens. A bias of +8 on one token makes it the likeliest after processing; the
    reported top 3 stay transformers' raw top 3, and each sampled token's logprob its raw one."""
    biased = int(hf_logprobs(PROMPT)[-1].argmin())
    kwargs: dict[str, Any] = {
        "model": "",
        "prompt": PROMPT,
        "logprobs": 3,
        "max_tokens": 8,
        "temperature": 1.3,
        "seed": 7,
        "presence_penalty": 0.8,
        "frequency_penalty": 0.6,
        "logit_bias": {str(biased): 8.0},
    }
    # Each call in its own cache namespace, so that both prefill the whole prompt: float32 products are
    # not row-invariant (model/linear.py), so a cached prompt's one-row prefill may differ in the last bits.
    extra = {"repetition_penalty": 1.3, "min_tokens": 8, "ignore_eos": True, "cache_salt": "raw-first"}
    text, tokens, values, tops, offsets = _legacy_logprobs(client, False, extra_body=extra, **kwargs)
    generated = _resolve_ids(hf_tokenizer, PROMPT, tokens, values, hf_logprobs)
    assert biased in generated, "the bias was applied to the sampling"
    expected = hf_logprobs(PROMPT + generated)
    for j, top in enumerate(tops):
        row = expected[len(PROMPT) - 1 + j]
        assert abs(values[j] - row[generated[j]].item()) < 1e-4
        assert_top_equals(top, _expected_top(hf_tokenizer, row, 3))
    # The same seed with the same processing samples the same tokens (and the same raw logprobs).
    again = _legacy_logprobs(client, True, extra_body={**extra, "cache_salt": "raw-again"}, **kwargs)
    assert again == (text, tokens, values, tops, offsets)


def test_legacy_top_logprobs_keep_the_likeliest_of_tokens_sharing_a_text(default_model: Any) -> None:
    """Regression: the legacy top_logprobs dict is keyed by token text, and pieces of a UTF-8 character
    all read U+FFFD; the less likely piece's logprob used to overwrite the likelier one's."""
    from kvserve.engine.logprobs import TokenLogprob
    from kvserve.server.openai.logprobs import LogprobRenderer

    tokenizer = default_model.tokenizer
    first, second = [t for t in range(4096) if tokenizer.token_text(t) == "\ufffd"][:2]
    entry = TokenLogprob(token_id=first, logprob=-0.5, rank=1, top=((first, -0.5), (second, -3.0), (7, -4.0)))
    rendered, _ = LogprobRenderer(tokenizer).legacy([first], [entry], 0)
    assert rendered.top_logprobs == [{"\ufffd": -0.5, tokenizer.token_text(7): -4.0}]
