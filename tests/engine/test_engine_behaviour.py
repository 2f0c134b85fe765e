"""Engine behaviour: batching, chunking, preemption, sampling, stops, refusals; on the default model where
its text matters, on the tiny full-vocabulary model where only the scheduling or the sampler does."""

import random
from collections.abc import Callable
from typing import Any

import pytest

from kvserve.config import EngineConfig, default_cache_dir
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.model.loader import LoadedModel, load_model
from tests.engine.steps import GREEDY, run
from tests.harness import assert_no_leak
from tests.helpers import save_tiny_model

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colors and explain why they are called primary.",
    "What is 2+2?",
    "Explain in one sentence what a CPU cache does.",
    "Give me a short list of fruits that are red, with one fact about each of them please.",
    "Hi",
    "Translate 'good morning' to French and German.",
]


def chat_prompts(engine: Engine) -> dict[str, list[int]]:
    tok = engine.tokenizer
    return {f"q{i}": tok.encode_chat([{"role": "user", "content": q}]) for i, q in enumerate(QUESTIONS)}


@pytest.fixture(scope="module")
def prompts(make_engine: Callable[..., Engine]) -> dict[str, list[int]]:
    return chat_prompts(make_engine())


@pytest.fixture(scope="module")
def alone(make_engine: Callable[..., Engine], prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    engine = make_engine(enable_prefix_caching=False)
    return {rid: run(engine, {rid: ids})[rid] for rid, ids in prompts.items()}


@pytest.mark.parametrize(
    "settings",
    [
        {"max_num_batched_tokens": 16, "block_size": 4},
        {"max_num_batched_tokens": 64, "block_size": 16},
        {"max_num_batched_tokens": 2048, "block_size": 32},
        {"max_num_batched_tokens": 2048, "block_size": 16, "enable_prefix_caching": False},
    ],
)
def test_greedy_tokens_are_the_same_alone_and_in_a_batch(
    make_engine: Callable[..., Engine],
    prompts: dict[str, list[int]],
    alone: dict[str, list[int]],
    settings: dict[str, Any],
) -> None:
    engine = make_engine(**settings)
    assert run(engine, prompts) == alone
    assert_no_leak(engine)


def test_preemption_recomputes_and_gives_the_same_tokens(
    make_engine: Callable[..., Engine], prompts: dict[str, list[int]], alone: dict[str, list[int]]
) -> None:
    # 12 blocks of 16 tokens cannot hold 8 requests of ~40-60 tokens each: the scheduler must preempt.
    # The default KV cache is float16: 23,040 bytes a token for the default model.
    engine = make_engine(kv_cache_memory=12 * 16 * 23040, block_size=16)
    assert run(engine, prompts) == alone
    assert engine.stats().preemptions > 0
    assert_no_leak(engine)


def test_seeded_sampling_is_reproducible_whatever_the_batch(make_tiny_engine: Callable[..., Engine]) -> None:
    engine = make_tiny_engine()
    prompts = chat_prompts(engine)
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, min_p=0.01, seed=1234)
    first = run(engine, {"a": prompts["q1"]}, seeded)["a"]
    for rid, ids in prompts.items():
        engine.add_request("noise-" + rid, ids, SamplingParams(max_tokens=10, temperature=1.0))
    engine.add_request("b", prompts["q1"], seeded)
    second: list[int] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.request_id == "b":
                second += delta.token_ids
    assert first == second
    unseeded = [
        run(engine, {f"u{i}": prompts["q1"]}, SamplingParams(max_tokens=16))[f"u{i}"] for i in range(3)
    ]
    assert len({tuple(u) for u in unseeded}) > 1


def test_stop_strings_are_cut_and_never_streamed(
    make_engine: Callable[..., Engine], prompts: dict[str, list[int]]
) -> None:
    engine = make_engine()
    full = engine.tokenizer.decode(
        run(engine, {"x": prompts["q5"]}, SamplingParams(max_tokens=40, temperature=0))["x"]
    )
    stop = full[10:14]
    engine.add_request("s", prompts["q5"], SamplingParams(max_tokens=40, temperature=0, stop=[stop, "zzzz"]))
    text, reasons = "", []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            text += delta.text
            reasons.append(delta.finish_reason)
    assert text == full[: full.index(stop)]
    assert reasons[-1] == "stop"


def test_eos_stop_token_ids_ignore_eos_and_length(
    make_engine: Callable[..., Engine], prompts: dict[str, list[int]]
) -> None:
    engine = make_engine()
    eos = engine.tokenizer.eos_token_ids[0]
    natural = run(engine, {"n": prompts["q0"]}, SamplingParams(max_tokens=64, temperature=0))["n"]
    assert natural[-1] == eos and len(natural) < 64
    first = natural[0]
    stopped = run(
        engine, {"t": prompts["q0"]}, SamplingParams(max_tokens=64, temperature=0, stop_token_ids=[first])
    )
    assert stopped["t"] == [first]
    forced = run(
        engine,
        {"f": prompts["q0"]},
        SamplingParams(max_tokens=len(natural) + 5, temperature=0, ignore_eos=True),
    )
    assert len(forced["f"]) == len(natural) + 5
    engine.add_request("l", prompts["q0"], SamplingParams(max_tokens=3, temperature=0))
    last = None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            last = delta
    assert last is not None and last.finish_reason == "length" and last.num_output_tokens == 3


def test_streamed_text_never_splits_a_character(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine()
    tok = engine.tokenizer
    ids = tok.encode("Emoji and accents: 😀🎉 naïve café — 日本語のテキスト")
    # Feeding the text's own tokens one at a time is what a stream of generated tokens looks like.
    stream = tok.decode_stream()
    pieces = [stream.step(t) for t in ids]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_requests_that_can_never_run_are_refused(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(max_model_len=64)
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        engine.add_request("long", list(range(100, 180)), GREEDY)
    with pytest.raises(InvalidRequestError, match="max_tokens") as e:
        engine.add_request("long2", list(range(100, 140)), SamplingParams(max_tokens=40))
    assert e.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request("vocab", [10**7], GREEDY)
    small = make_engine(kv_cache_memory=4 * 16 * 23040)
    with pytest.raises(InvalidRequestError, match="kv_cache_memory"):
        small.add_request("big", list(range(100, 140)), SamplingParams(max_tokens=100))
    assert not engine.has_unfinished_requests() and not small.has_unfinished_requests()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 2.0),
        ("max_tokens", -1),
        ("n", 0),
        ("logprobs", 21),
        ("prompt_logprobs", -1),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("logit_bias", {5: 200.0}),
        ("min_tokens", -1),
        ("seed", -1),
    ],
)
def test_bad_sampling_values_are_refused(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_no_block_leaks_after_random_requests_aborts_and_preemptions(
    tiny_full_vocab_model: LoadedModel,
) -> None:
    model = tiny_full_vocab_model
    config = EngineConfig(
        kv_cache_memory=40 * 4 * model.config.kv_bytes_per_token(2), block_size=4, max_num_batched_tokens=48
    )
    engine = Engine.from_config(config, model=model)
    rng = random.Random(7)
    live: set[str] = set()
    prefixes = [[rng.randrange(49152) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    for i in range(300):
        prompt = rng.choice(prefixes) + [rng.randrange(49152) for _ in range(rng.randrange(1, 12))]
        params = SamplingParams(
            max_tokens=rng.randrange(1, 20), temperature=rng.choice([0.0, 1.0]), ignore_eos=True
        )
        engine.add_request(f"r{i}", prompt, params)
        live.add(f"r{i}")
        for _ in range(rng.randrange(0, 3)):
            for delta in engine.step():
                if delta.finished:
                    live.discard(delta.request_id)
        if live and rng.random() < 0.2:
            victim = rng.choice(sorted(live))
            assert engine.abort_request(victim)
            live.discard(victim)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().preemptions > 0
    assert_no_leak(engine)
    engine.reset_prefix_cache()
    assert engine.kv.pool.num_free == engine.num_blocks


def test_running_streams_keep_decoding_while_a_long_prompt_prefills(
    make_tiny_engine: Callable[..., Engine],
) -> None:
    engine = make_tiny_engine(max_num_batched_tokens=64)
    prompts = chat_prompts(engine)
    engine.add_request(
        "stream", prompts["q0"], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    )
    while not any(d.request_id == "stream" for d in engine.step()):
        pass
    long_prompt = engine.tokenizer.encode(" ".join(QUESTIONS) * 4)
    assert len(long_prompt) > 4 * 64
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=1, temperature=0))
    steps = 0
    while True:
        ids = {d.request_id for d in engine.step()}
        steps += 1
        assert "stream" in ids, "a running stream missed a step while another request prefilled"
        if "long" in ids:
            break
    assert steps >= len(long_prompt) // 64
    engine.abort_request("stream")
    assert_no_leak(engine)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_is_a_setting(tmp_path: Any, dtype: str) -> None:
    model = load_model(save_tiny_model(str(tmp_path / "tiny"), "qwen2"), default_cache_dir())
    engine = Engine.from_config(EngineConfig(kv_cache_memory=2**22, dtype=dtype), model=model)
    assert str(engine.runner.kv_cache.k.dtype) == f"torch.{dtype}"
    out = run(
        engine, {"a": list(range(100, 140))}, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    )
    assert len(out["a"]) == 5
    assert_no_leak(engine)


def test_one_token_steps_run_on_their_own_thread_count(
    make_engine: Callable[..., Engine], prompts: dict[str, list[int]], alone: dict[str, list[int]]
) -> None:
    """`single_token_threads` changes how a lone decode runs, never what it computes, and a step of more
    tokens gets the engine's thread count back."""
    import torch

    engine = make_engine(enable_prefix_caching=False, single_token_threads=1)
    threads = engine._threads
    seen: list[tuple[int, int]] = []
    original = engine.runner.execute

    def execute(batch: Any) -> Any:
        rows = len(batch.decodes) + sum(len(c.token_ids) for c in batch.prefills)
        seen.append((rows, torch.get_num_threads()))
        return original(batch)

    engine.runner.execute = execute  # type: ignore[method-assign]
    rid, ids = next(iter(prompts.items()))
    assert run(engine, {rid: ids}) == {rid: alone[rid]}
    # The prefill step runs on the engine's threads, every one-token decode step after it on one, and a
    # decode with a draft (rows of its own) on the engine's threads again.
    assert seen[0][1] == threads and any(rows == 1 for rows, _ in seen)
    assert all(n == (1 if rows == 1 else threads) for rows, n in seen)
    torch.set_num_threads(threads)
