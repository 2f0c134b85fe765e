"""A hybrid model (LFM2's short convolutions beside attention) keeps its cache like an attention model:
over a 10-turn chat each turn finds everything before its new message cached (what the previous turn
computed: its prompt and its reply but the reply's last token, which no step feeds), nothing recomputed;
a system prompt shared by many users is computed once when the request names its end; and the same chat
without the prefix cache gives the same tokens."""

import tempfile
from collections.abc import Sequence
from dataclasses import replace

import pytest

from kvserve.cache.cache_miss import MISS_NO_CHECKPOINT, CacheMiss
from kvserve.config import EngineConfig, default_cache_dir
from kvserve.engine.chat import reply_turn_start
from kvserve.engine.engine import Engine
from kvserve.engine.factory import STATE_SHARE, state_slots
from kvserve.engine.sampling_params import SamplingParams
from kvserve.errors import ConfigError
from kvserve.model.loader import LoadedModel, load_model
from kvserve.model.tokenizer import MessageDict, TemplateArgs
from kvserve.sequences import common_prefix_len
from tests.harness import engine_with_blocks, run_counted
from tests.helpers import save_tiny_model
from tests.model.family_cases import LFM2_HYBRID
from tests.server import chat_templates


@pytest.fixture(scope="module")
def lfm2() -> LoadedModel:
    folder = tempfile.mkdtemp(prefix="kvserve-lfm2-")
    return load_model(
        save_tiny_model(folder + "/m", "lfm2", vocab_size=4096, **LFM2_HYBRID), default_cache_dir()
    )


def _run(
    engine: Engine, rid: str, prompt: list[int], checkpoints: Sequence[int] = ()
) -> tuple[list[int], int, int]:
    return run_counted(engine, rid, prompt, 9, checkpoints)


@pytest.mark.parametrize("speculative", ["off", "suffix"])
@pytest.mark.parametrize("interval", [0, 16])
def test_ten_turns_hit_everything_before_the_new_message(
    lfm2: LoadedModel, speculative: str, interval: int
) -> None:
    engine = engine_with_blocks(lfm2, 200, 4, speculative=speculative, state_checkpoint_interval=interval)
    fresh = engine_with_blocks(lfm2, 200, 4, speculative="off", enable_prefix_caching=False)
    history = list(range(100, 113))
    ideal = 0
    fractions = []
    for turn in range(10):
        reply, cached, recomputed = _run(engine, f"t{turn}", history)
        assert reply == _run(fresh, f"t{turn}", history)[0]
        assert (cached, recomputed) == (ideal, 0), turn
        fractions.append(cached / len(history))
        ideal = len(history) + len(reply) - 1
        history = history + reply + [200 + turn, 300 + turn, 400 + turn, 500 + turn, 600 + turn]
    print("cached fraction per turn:", " ".join(f"{f:.3f}" for f in fractions))
    assert engine.stats().recomputed_tokens == 0


def test_a_shared_system_prompt_is_computed_once(lfm2: LoadedModel) -> None:
    engine = engine_with_blocks(lfm2, 200, 4, speculative="off")
    system = list(range(100, 130))
    before = engine.stats().prefill_tokens_computed
    for user in range(5):
        question = [1000 + user, 1100 + user, 1200 + user]
        _, cached, recomputed = _run(engine, f"u{user}", system + question, checkpoints=[len(system)])
        assert (cached, recomputed) == ((0, 0) if user == 0 else (len(system), 0))
    assert engine.stats().prefill_tokens_computed - before == len(system) + 5 * 3


def test_a_match_past_the_last_checkpoint_counts_what_it_recomputes(lfm2: LoadedModel) -> None:
    """Without the boundary, a second user's prompt shares the system prompt's KV but no checkpoint
    there: the hit resumes from nothing and the shared tokens are counted as recomputed. That prefill
    leaves a checkpoint where the prompts branch, so a third user recomputes nothing."""
    from kvserve.server.http.metrics import EngineStatsCollector

    engine = engine_with_blocks(lfm2, 200, 4, speculative="off")
    system = list(range(100, 130))
    _run(engine, "a", [*system, 7, 8, 9])
    _, cached, recomputed = _run(engine, "b", [*system, 17, 18, 19])
    assert (cached, recomputed) == (0, len(system))
    stats = engine.stats()
    assert stats.recomputed_tokens == len(system)
    assert 0 < stats.cache.num_state_checkpoints <= stats.cache.max_state_checkpoints
    collector = EngineStatsCollector("m")
    collector.stats = stats
    values = {s.name: s.value for family in collector.collect() for s in family.samples}
    assert values["kvserve_state_recomputed_tokens_total"] == len(system)
    assert values["kvserve_state_checkpoints"] == stats.cache.num_state_checkpoints
    assert _run(engine, "c", [*system, 27, 28, 29])[1:] == (len(system), 0)


def test_a_recomputed_match_is_a_no_checkpoint_miss(lfm2: LoadedModel) -> None:
    """The tokens recomputed for want of a checkpoint are the request's miss, reason no_checkpoint (what
    every API reports), and counted by that reason."""
    engine = engine_with_blocks(lfm2, 200, 4, speculative="off")
    system = list(range(100, 130))
    _run(engine, "a", [*system, 7, 8, 9])
    engine.add_request(
        "b", [*system, 17, 18, 19], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    )
    misses: list[CacheMiss] = []
    while engine.has_unfinished_requests():
        misses += [d.cache_miss for d in engine.step() if d.cache_miss is not None]
    assert misses and {m.reason for m in misses} == {MISS_NO_CHECKPOINT}
    assert misses[0].cached_tokens == 0 and misses[0].missed_tokens >= len(system) // 4 * 4
    assert engine.stats().misses_by_reason == {MISS_NO_CHECKPOINT: 1}


def test_message_ends_are_checkpointed_without_being_named(lfm2: LoadedModel) -> None:
    """A chat template closes each message with an end-of-turn token: the engine keeps the state after
    each, so users sharing a system message share its computation though no caller named its end."""
    engine = engine_with_blocks(lfm2, 200, 4, speculative="off")
    (eos,) = engine.tokenizer.eos_token_ids
    system = [*range(100, 129), eos]
    assert engine.turn_ends([*system, 5, eos, 6]) == [30, 32]
    for user in range(3):
        _, cached, recomputed = _run(engine, f"u{user}", [*system, 1000 + user, 1100 + user])
        assert (cached, recomputed) == ((0, 0) if user == 0 else (len(system), 0))


def test_the_door_passes_a_request_s_checkpoints(lfm2: LoadedModel) -> None:
    """`AsyncEngine.generate`'s checkpoints (the server's cache breakpoints) reach the engine: a second
    prompt sharing the first one's prefix up to a named position resumes there."""
    import asyncio

    from kvserve.engine.async_engine import AsyncEngine

    door = AsyncEngine(engine_with_blocks(lfm2, 200, 4, speculative="off"))
    shared = list(range(100, 127))

    async def cached(prompt: list[int]) -> int:
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        deltas = [d async for d in door.generate(prompt, params, checkpoints=[len(shared)])]
        return deltas[-1].num_cached_tokens

    try:
        assert asyncio.run(cached([*shared, 7, 8])) == 0
        assert asyncio.run(cached([*shared, 9, 10])) == len(shared)
    finally:
        door.shutdown()


def test_drafts_stop_at_checkpoint_positions(lfm2: LoadedModel) -> None:
    """With mostly right drafts and a checkpoint every 4 tokens, a reply of 24 tokens is checkpointed at
    every multiple of 4 all the same: no draft runs past one, and no rejection loses one."""
    from kvserve.cache.prefix_cache import PrefixCache
    from tests.harness import OracleDrafter

    engine = engine_with_blocks(lfm2, 200, 4, speculative="suffix", state_checkpoint_interval=4)
    oracle = OracleDrafter(
        engine_with_blocks(lfm2, 200, 4, speculative="off", enable_prefix_caching=False), 1
    )
    engine.scheduler.drafter = oracle
    prompt = list(range(100, 110))
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    oracle.added("r", prompt, params)
    engine.add_request("r", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
        engine.kv.check()
    assert engine.stats().spec_accepted_tokens > 0
    tree = engine.kv.prefix_cache
    assert isinstance(tree, PrefixCache)
    ends = set()
    for slot in tree.checkpoint_slots():
        node, k = tree._checkpoints[slot]
        ends.add(node.depth - len(node.tokens) + k)
    assert set(range(4, 10 + 24, 4)) <= ends, sorted(ends)


def test_states_too_big_for_the_defaults_shrink_the_running_sequences(lfm2: LoadedModel) -> None:
    """A real hybrid's state is megabytes (Qwen3.5-0.8B's 19 MiB): the default 64 running sequences
    and 256 checkpoints would not fit the pool. The live states and the checkpoints then take a quarter
    of the memory each, the engine runs as many sequences as it has live slots, and serves."""
    per_slot = state_slots(EngineConfig(), lfm2)[2] // (1 + 64 + 256)
    config = EngineConfig(kv_cache_memory=40 * STATE_SHARE * per_slot, block_size=4, dtype="float32")
    engine = Engine.from_config(config, model=lfm2)
    assert engine.config.max_num_seqs == 40
    assert engine.kv.states.checkpoint_slots == 40
    reply, _, _ = _run(engine, "a", list(range(100, 140)))
    assert len(reply) == 9
    with pytest.raises(ConfigError, match="recurrent state"):
        Engine.from_config(replace(config, kv_cache_memory=per_slot), model=lfm2)


@pytest.mark.parametrize("kept", [True, False])
def test_the_next_turn_resumes_where_the_generation_prompt_parts_from_the_reply(kept: bool) -> None:
    """Qwen3's template with thinking off ends the generation prompt with an empty think block, which
    it drops from the reply's turn once a user message follows: turn 2 shares turn 1's prompt up to
    the end of the turn's header. With the state kept there (`reply_turn_start`, which the server
    passes), turn 2 reads all of it from the cache, the ideal, nothing recomputed; without it, the
    hit resumes at the last message end and the header is recomputed (counted)."""
    folder = tempfile.mkdtemp(prefix="kvserve-lfm2-")
    model = load_model(save_tiny_model(folder + "/m", "lfm2", **LFM2_HYBRID), default_cache_dir())
    tokenizer = model.tokenizer
    args = TemplateArgs(source=chat_templates.QWEN3, kwargs={"enable_thinking": False})
    chat: list[MessageDict] = [
        {"role": "system", "content": "Answer briefly. " * 6},
        {"role": "user", "content": "Hello there."},
    ]
    engine = engine_with_blocks(model, 200, 4, speculative="off")
    prompt = tokenizer.encode_chat(chat, True, args=args)
    start = reply_turn_start(tokenizer, chat, args, prompt)
    assert start is not None
    assert prompt[start:] == tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    reply, _, _ = _run(engine, "one", prompt, [start] if kept else [])
    text = tokenizer.decode(reply, skip_special_tokens=True)
    turn = [*chat, {"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    second = tokenizer.encode_chat(turn, True, args=args)
    ideal = common_prefix_len(prompt + reply, second)
    assert ideal == start
    _, cached, recomputed = _run(engine, "two", second)
    if kept:
        assert (cached, recomputed) == (ideal, 0)
    else:
        assert cached + recomputed == ideal and 0 < recomputed < 8
