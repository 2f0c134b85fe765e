"""Prefix caching in the engine: transparency, cached-token counts, shared prefixes, multi-turn, order."""

from collections.abc import Callable

from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.model.loader import LoadedModel
from kvserve.model.tokenizer import MessageDict
from tests.engine.steps import run
from tests.harness import assert_no_leak

SYSTEM = (
    "You are a meticulous assistant for a small bakery. You answer questions about opening hours, "
    "ingredients, allergies, prices and custom orders. Opening hours are 7am to 6pm on weekdays and "
    "8am to 2pm on Saturdays; the bakery is closed on Sundays. All bread is baked daily with organic "
    "flour. Nut-free options are available but the kitchen handles nuts. Custom cakes need three days "
    "notice. Keep answers short, friendly and precise, and never invent products that are not listed. "
) * 3
USER_TURNS = [
    "When do you open on Saturday?",
    "Do you have nut-free bread?",
    "Can I order a cake for tomorrow?",
    "Thanks!",
]


def chat(engine: Engine, turns: list[str], max_tokens: int = 16) -> tuple[list[str], list[int], list[int]]:
    """A multi-turn chat resending the full history; returns replies, prompt sizes and cached tokens."""
    messages: list[MessageDict] = [{"role": "system", "content": SYSTEM}]
    replies, prompt_sizes, cached = [], [], []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        ids = engine.tokenizer.encode_chat(messages, known_reply=lambda text: engine.replies.lookup("", text))
        engine.add_request(f"turn{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=0))
        text, n_cached = "", -1
        while engine.has_unfinished_requests():
            for delta in engine.step():
                text += delta.text
                n_cached = delta.num_cached_tokens
        messages.append({"role": "assistant", "content": text})
        replies.append(text)
        prompt_sizes.append(len(ids))
        cached.append(n_cached)
    return replies, prompt_sizes, cached


def test_multi_turn_chat_is_transparent_and_hits_everything_before_the_new_message(
    make_tiny_engine: Callable[..., Engine],
) -> None:
    # The tiny full-vocabulary model: the default tokenizer and chat template, at a fraction of the cost.
    cold = chat(make_tiny_engine(enable_prefix_caching=False), USER_TURNS)
    engine = make_tiny_engine()
    replies, sizes, cached = chat(engine, USER_TURNS)
    assert replies == cold[0]
    assert cold[2] == [0] * len(USER_TURNS)
    assert cached[0] == 0
    for k in range(1, len(USER_TURNS)):
        reply_tokens = len(engine.tokenizer.encode(replies[k - 1], add_special_tokens=False))
        assert cached[k] >= sizes[k - 1] + reply_tokens - engine.config.block_size
    assert_no_leak(engine)


def test_replies_are_reused_as_their_generated_token_ids(make_engine: Callable[..., Engine]) -> None:
    engine = make_engine(block_size=16)
    messages: list[MessageDict] = [{"role": "user", "content": "Tell me a fun fact about octopuses."}]
    ids = engine.tokenizer.encode_chat(messages)
    out = run(engine, {"a": ids}, SamplingParams(max_tokens=64, temperature=0))["a"]
    reply_ids = out[:-1] if out[-1] in engine.tokenizer.eos_token_ids else out
    text = engine.tokenizer.decode(reply_ids)
    follow = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "Another one?"}]
    spliced = engine.tokenizer.encode_chat(follow, known_reply=lambda t: engine.replies.lookup("", t))
    assert spliced[: len(ids) + len(reply_ids)] == ids + reply_ids
    assert engine.replies.lookup("other-namespace", text) is None


def test_shared_system_prompt_arriving_together_is_computed_once(
    make_tiny_engine: Callable[..., Engine],
) -> None:
    # The tiny model: what is computed once does not depend on the model, and the reference run without
    # the cache prefills every prompt in full (about 11,000 tokens).
    engine = make_tiny_engine(max_num_batched_tokens=256, block_size=16)
    tok = engine.tokenizer
    system = tok.encode(SYSTEM * 2)
    questions = [tok.encode(f" Question {i}: what about item number {i * 7}?") for i in range(16)]
    prompts = {f"u{i}": system + q for i, q in enumerate(questions)}
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = run(engine, prompts, params)
    unique = sum(len(q) for q in questions)
    stats = engine.stats()
    # Every prompt's last token is recomputed (its logits are needed), hence the 16 x block size slack.
    assert stats.prefill_tokens_computed <= len(system) + unique + 16 * engine.config.block_size
    assert stats.cache_hits >= 15 * (len(system) - engine.config.block_size)
    assert out == run(
        make_tiny_engine(enable_prefix_caching=False, max_num_batched_tokens=256), prompts, params
    )
    assert_no_leak(engine)


def test_caching_stays_transparent_when_a_small_pool_forces_eviction(
    make_tiny_engine: Callable[..., Engine], tiny_full_vocab_model: LoadedModel
) -> None:
    # The tiny model: eviction and transparency do not depend on the model, and on the default model the
    # 16 prompts alone, in a batch and without the cache cost a minute or more.
    tok = make_tiny_engine().tokenizer
    prompts = {
        f"c{i}": tok.encode_chat(
            [
                {"role": "system", "content": f"Case {i % 4}. " + SYSTEM[: 300 + 60 * i]},
                {"role": "user", "content": q},
            ]
        )
        for i, q in enumerate(USER_TURNS * 2)
    }
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = run(make_tiny_engine(enable_prefix_caching=False), prompts, params)
    # 40 blocks of 16 tokens in the float16 KV cache.
    block_bytes = 16 * tiny_full_vocab_model.config.kv_bytes_per_token(2)
    engine = make_tiny_engine(kv_cache_memory=40 * block_bytes, block_size=16, max_num_seqs=2)
    for rid, ids in prompts.items():
        assert run(engine, {rid: ids}, params)[rid] == expected[rid]
    assert run(engine, prompts, params) == expected
    assert engine.stats().cache.num_evicted > 0
    assert_no_leak(engine)


def test_disabled_cache_and_reset(make_tiny_engine: Callable[..., Engine]) -> None:
    tok = make_tiny_engine().tokenizer
    ids = tok.encode(SYSTEM)
    params = SamplingParams(max_tokens=2, temperature=0)
    off = make_tiny_engine(enable_prefix_caching=False)
    run(off, {"a": ids}, params)
    run(off, {"b": ids}, params)
    assert off.stats().cache_hits == 0 and off.stats().cache.num_cached == 0
    on = make_tiny_engine()
    run(on, {"a": ids}, params)
    on.add_request("b", ids, params)
    deltas = [d for _ in range(3) for d in on.step()]
    assert deltas[0].num_cached_tokens == len(ids) - 1
    assert on.reset_prefix_cache() > 0
    assert on.stats().cache.num_cached == 0
    assert on.stats().hit_rate > 0


def _admission_order(engine: Engine, prompts: dict[str, list[int]]) -> list[str]:
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0))
    order: list[str] = []
    while engine.has_unfinished_requests():
        order += [d.request_id for d in engine.step() if d.finished]
    return order


def test_waiting_queue_favours_the_longest_cached_prefix_within_a_bound(
    make_tiny_engine: Callable[..., Engine],
) -> None:
    shared = list(range(1000, 1100))
    cold = [list(range(2000 + 100 * i, 2100 + 100 * i)) for i in range(4)]
    engine = make_tiny_engine(max_num_seqs=1, cache_aware_scheduling_bound=100)
    _admission_order(engine, {"warmup": [*shared, 1]})
    prompts = {"cold0": cold[0], "cold1": cold[1], "hot": [*shared, 5], "cold2": cold[2]}
    order = _admission_order(engine, prompts)
    assert order.index("hot") < order.index("cold1")
    bounded = make_tiny_engine(max_num_seqs=1, cache_aware_scheduling_bound=0)
    _admission_order(bounded, {"warmup": [*shared, 1]})
    assert _admission_order(bounded, prompts) == list(prompts)


def test_replies_cut_by_max_tokens_are_remembered_but_not_those_cut_by_a_stop_string(
    make_engine: Callable[..., Engine],
) -> None:
    engine = make_engine()
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Count from one to twenty in words."}])
    out = run(engine, {"a": ids}, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))["a"]
    assert engine.replies.lookup("", engine.tokenizer.decode(out)) == out
    full = engine.tokenizer.decode(run(engine, {"b": ids}, SamplingParams(max_tokens=12, temperature=0))["b"])
    stop = full[8:11]
    engine.add_request("c", ids, SamplingParams(max_tokens=12, temperature=0, stop=[stop]))
    text = "".join(d.text for _ in range(14) for d in engine.step())
    assert text == full[: full.index(stop)]
    assert engine.replies.lookup("", text) is None


def greedy_with_logprobs(engine: Engine, rid: str, ids: list[int], n: int) -> list[tuple[int, float]]:
    engine.add_request(rid, ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0))
    out: list[tuple[int, float]] = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out += [(lp.token_id, lp.logprob) for lp in delta.logprobs]
    return out


def test_a_reply_computed_by_decode_rows_reads_back_as_its_prefill_would_bit_for_bit(
    make_tiny_engine: Callable[..., Engine],
) -> None:
    """The next turn's prompt holds the reply, whose KV the decode rows wrote: from the cache, it gives the
    next reply the same tokens with the same log probabilities, to the bit, as prefilling it afresh. The
    native q8_0 products in int16 mode (the default), whose decode and prefill rows are the same integer
    products; the same in the float32 mode."""
    for activations in ("int16", "float32"):
        settings = {"weight_dtype": "q8_0", "activations": activations, "block_size": 16}
        warm = make_tiny_engine(**settings)
        tok = warm.tokenizer
        prompt = tok.encode(SYSTEM)
        reply = [t for t, _ in greedy_with_logprobs(warm, "a", prompt, 40)]
        follow = [*prompt, *reply, *tok.encode(" And on Sunday?")]
        cached = greedy_with_logprobs(warm, "b", follow, 12)
        assert warm.stats().cache_hits >= len(prompt) + len(reply) - 16
        fresh = make_tiny_engine(enable_prefix_caching=False, **settings)
        cold = greedy_with_logprobs(fresh, "b", follow, 12)
        assert cached == cold, activations
