"""A hybrid model's state checkpoints carried by the disk and Redis tiers (cache/tier_states.py): an
engine writes its checkpoints beside its blocks, a new engine on the same tier (a restart) resumes from
them, its output equal to a fresh no-cache run with nothing recomputed; and a checkpoint value that is
truncated, corrupt, of another layout, namespace or model is a counted miss, never a wrong state."""

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from kvserve.cache.tier_loads import TierLoads
from kvserve.cache.tiers import TIER_DISK, TIER_REDIS
from kvserve.engine.engine import Engine
from kvserve.model.loader import LoadedModel
from tests.harness import engine_with_blocks, run_counted
from tests.redis_server import RedisServer

SECRET = bytes(range(32))
BLOCK = 4
HYBRIDS = ["lfm2-hybrid", "qwen3_5-hybrid"]
# A prompt of 8 blocks and a token: its cacheable part (all but the last token) ends at a block's end,
# where the prompt's own checkpoint (the token before its end) lies.
PROMPT = list(range(100, 133))

pytestmark = pytest.mark.usefixtures("one_thread")


def _engine(model: LoadedModel, disk: Path | None, redis: RedisServer | None, **overrides: object) -> Engine:
    return engine_with_blocks(
        model,
        64,
        BLOCK,
        kv_disk=str(disk) if disk is not None else None,
        kv_remote=redis.url if redis is not None else None,
        secret=SECRET,
        speculative="off",
        **overrides,
    )


def _run(engine: Engine, prompt: list[int], namespace: str = "") -> tuple[list[int], int, int]:
    rid = f"r{len(engine.scheduler.waiting)}{os.urandom(4).hex()}"
    return run_counted(engine, rid, prompt, 6, namespace=namespace)


@pytest.fixture(scope="module")
def fresh(family_model: Callable[[str], LoadedModel]) -> Callable[[str], list[int]]:
    """The reply of a no-cache engine to PROMPT, per model kind."""
    replies: dict[str, list[int]] = {}

    def get(kind: str) -> list[int]:
        if kind not in replies:
            engine = engine_with_blocks(family_model(kind), 64, BLOCK, enable_prefix_caching=False)
            replies[kind] = _run(engine, PROMPT)[0]
        return replies[kind]

    return get


def _write_then_restart(
    model: LoadedModel, disk: Path | None, redis: RedisServer | None, namespace: str = ""
) -> tuple[Engine, list[int]]:
    """An engine serves PROMPT and closes (writing what it queued); a new one on the same tiers
    returns, with the first engine's reply."""
    first = _engine(model, disk, redis)
    reply = _run(first, PROMPT, namespace)[0]
    first.close()
    return _engine(model, disk, redis), reply


@pytest.mark.parametrize("kind", HYBRIDS)
@pytest.mark.parametrize("tier", [TIER_DISK, TIER_REDIS])
def test_a_restarted_engine_resumes_from_a_tier_s_checkpoint(
    family_model: Callable[[str], LoadedModel],
    fresh: Callable[[str], list[int]],
    redis_server: RedisServer,
    tmp_path: Path,
    kind: str,
    tier: str,
) -> None:
    model = family_model(kind)
    disk, redis = (tmp_path, None) if tier == TIER_DISK else (None, redis_server)
    engine, reply = _write_then_restart(model, disk, redis)
    try:
        assert reply == fresh(kind)
        again, cached, recomputed = _run(engine, PROMPT)
        assert again == fresh(kind)
        assert (cached, recomputed) == (len(PROMPT) - 1, 0)
        stats = engine.stats()
        assert stats.hits_by_tier[tier] == len(PROMPT) - 1
        assert stats.recomputed_tokens == 0 and not stats.misses_by_reason
        # A chat's next turn on the restarted engine: the first turn's checkpoints still serve.
        follow = [*PROMPT, *again, 7, 8, 9]
        assert _run(engine, follow)[2] == 0
    finally:
        engine.close()


def test_without_the_checkpoint_the_loaded_blocks_are_recomputed_and_counted(
    family_model: Callable[[str], LoadedModel], fresh: Callable[[str], list[int]], tmp_path: Path
) -> None:
    """The blocks alone do not resume a hybrid model: with the checkpoint files gone, the KV loaded
    from disk is recomputed, counted (no_checkpoint) and the reply is still the fresh one."""
    model = family_model("lfm2-hybrid")
    engine, _ = _write_then_restart(model, tmp_path, None)
    try:
        states = [p for p in tmp_path.rglob("*.kv") if p.read_bytes().startswith(b"KVSSTATE")]
        assert states
        for path in states:
            path.unlink()
        engine.close()
        engine = _engine(model, tmp_path, None)
        again, cached, recomputed = _run(engine, PROMPT)
        assert again == fresh("lfm2-hybrid")
        assert cached == 0 and recomputed == len(PROMPT) - 1
        assert engine.stats().misses_by_reason == {"no_checkpoint": 1}
    finally:
        engine.close()


def _damage_states(tmp_path: Path, damage: Callable[[bytes], bytes]) -> int:
    count = 0
    for path in tmp_path.rglob("*.kv"):
        data = path.read_bytes()
        if data.startswith(b"KVSSTATE"):
            path.write_bytes(damage(data))
            count += 1
    return count


def _flip_last(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])


def _flip_payload(data: bytes) -> bytes:
    at = len(data) // 2
    return data[:at] + bytes([data[at] ^ 0x80]) + data[at + 1 :]


def _other_layout(data: bytes) -> bytes:
    # The same size, the header naming another layout: refused before the seal is even tried.
    at = data.index(b'"layout":"') + len(b'"layout":"')
    return data[:at] + (b"0" if data[at : at + 1] != b"0" else b"1") + data[at + 1 :]


@pytest.mark.parametrize(
    "damage",
    [lambda d: d[: len(d) // 2], _flip_last, _flip_payload, _other_layout, lambda d: d + b"\0"],
    ids=["truncated", "tag", "payload", "layout", "longer"],
)
def test_a_damaged_checkpoint_file_is_a_counted_miss(
    family_model: Callable[[str], LoadedModel],
    fresh: Callable[[str], list[int]],
    tmp_path: Path,
    damage: Callable[[bytes], bytes],
) -> None:
    model = family_model("lfm2-hybrid")
    engine, _ = _write_then_restart(model, tmp_path, None)
    engine.close()
    assert _damage_states(tmp_path, damage)
    engine = _engine(model, tmp_path, None)
    try:
        again, cached, recomputed = _run(engine, PROMPT)
        assert again == fresh("lfm2-hybrid")
        assert cached == 0 and recomputed == len(PROMPT) - 1
        (disk,) = engine.stats().cache.tiers
        assert disk.loads_failed >= 1
    finally:
        engine.close()


@pytest.mark.parametrize("corrupt", ["truncated", "foreign"])
def test_a_bad_checkpoint_value_in_redis_is_a_counted_miss(
    family_model: Callable[[str], LoadedModel],
    fresh: Callable[[str], list[int]],
    redis_server: RedisServer,
    corrupt: str,
) -> None:
    """Every value whose header names a state is damaged in place (truncated, or one state's value
    copied over another's name): each lookup that reaches one is a refused load."""
    model = family_model("lfm2-hybrid")
    engine, _ = _write_then_restart(model, None, redis_server)
    engine.close()
    client = redis_server.client()
    states = [k for k in client.scan_iter(b"kvserve:*") if client.getrange(k, 0, 3) == b"KVSS"]
    assert len(states) >= 2
    values = [client.get(k) for k in states]
    for i, key in enumerate(states):
        value, other = values[i], values[(i + 1) % len(values)]
        assert isinstance(value, bytes) and isinstance(other, bytes)
        client.set(key, value[: len(value) // 2] if corrupt == "truncated" else other)
    client.close()
    engine = _engine(model, None, redis_server)
    try:
        again, cached, recomputed = _run(engine, PROMPT)
        assert again == fresh("lfm2-hybrid")
        assert cached == 0 and recomputed == len(PROMPT) - 1
        (tier,) = engine.stats().cache.tiers
        assert tier.loads_failed >= 1
    finally:
        engine.close()


def test_another_namespace_or_model_finds_no_checkpoint(
    family_model: Callable[[str], LoadedModel], tmp_path: Path
) -> None:
    """Checkpoints written in one namespace, or by another model, are never found: the keys bind both."""
    engine, _ = _write_then_restart(family_model("lfm2-hybrid"), tmp_path, None, namespace="a")
    try:
        assert _run(engine, PROMPT, namespace="b")[1] == 0
        assert _run(engine, PROMPT, namespace="a")[1] == len(PROMPT) - 1
    finally:
        engine.close()
    other = _engine(family_model("qwen3_5-hybrid"), tmp_path, None)
    try:
        assert _run(other, PROMPT, namespace="a")[1:] == (0, 0)
    finally:
        other.close()


def test_a_checkpoint_whose_tensors_disagree_with_the_model_is_refused(
    family_model: Callable[[str], LoadedModel], fresh: Callable[[str], list[int]], tmp_path: Path
) -> None:
    """A state that passed the tier's checks but whose tensors disagree with the model's (the state
    writer's own guard, StateShapeError) is counted, in its tier's `loads_failed` too (/metrics), and
    never written into a slot."""
    engine, _ = _write_then_restart(family_model("lfm2-hybrid"), tmp_path, None)
    try:
        tiers = engine.kv.tiers
        assert isinstance(tiers, TierLoads) and tiers.states is not None
        real = tiers.states.unpack
        tiers.states.unpack = lambda packed: real(packed)[:-1]  # type: ignore[method-assign]
        again, cached, recomputed = _run(engine, PROMPT)
        assert again == fresh("lfm2-hybrid")
        assert (cached, recomputed) == (0, len(PROMPT) - 1)
        (tier,) = tiers.usage()
        assert tiers.states_refused == {tier.name: 1}
        assert tier.loads_failed == tiers.lower.usage()[0].loads_failed + 1
    finally:
        engine.close()


@pytest.mark.parametrize("kind", HYBRIDS)
def test_a_chat_s_next_turn_after_a_restart_recomputes_nothing(
    family_model: Callable[[str], LoadedModel], tmp_path: Path, kind: str
) -> None:
    """Turn 2 on a restarted engine: the tiers hold turn 1's whole blocks and, with a checkpoint every
    block, the state at their end; it resumes there, its reply that of a no-cache engine."""
    model = family_model(kind)
    first = _engine(model, tmp_path, None, state_checkpoint_interval=BLOCK)
    reply = _run(first, PROMPT)[0]
    first.close()
    turn2 = [*PROMPT, *reply, 7, 8, 9]
    engine = _engine(model, tmp_path, None, state_checkpoint_interval=BLOCK)
    plain = engine_with_blocks(model, 64, BLOCK, enable_prefix_caching=False)
    try:
        again, cached, recomputed = _run(engine, turn2)
        assert again == _run(plain, turn2)[0]
        # Turn 1 computed all but its reply's last token; the tiers hold its whole blocks.
        assert (cached, recomputed) == ((len(PROMPT) + len(reply) - 1) // BLOCK * BLOCK, 0)
        assert engine.stats().hits_by_tier[TIER_DISK] == cached
    finally:
        engine.close()


@pytest.mark.parametrize("lost", ["everything", "checkpoints"])
def test_a_load_restarted_after_memory_lost_its_checkpoint_looks_for_one_from_the_start(
    family_model: Callable[[str], LoadedModel], tmp_path: Path, lost: str
) -> None:
    """A load starts while memory holds a checkpoint, so its state lookup starts after it; memory then
    loses everything, or only its checkpoints, before the load is admitted. The load must be restarted
    to look for a checkpoint from the prompt's start again, and find the one the tier holds at the old
    lookup's start (a bug once: the restart kept the stale lookup, and a certain hit was missed)."""
    model = family_model("lfm2-hybrid")
    engine = _engine(model, tmp_path, None)
    try:
        # The disk holds a branch past PROMPT's first 32 tokens with no checkpoint before its 44th, and
        # PROMPT's own checkpoint at 32; memory keeps that checkpoint, not the branch's blocks past it.
        branch = [*PROMPT[:32], *range(200, 220)]
        _run(engine, branch)
        _run(engine, PROMPT)
        engine.kv.flush()
        prompt = [*branch[:44], 7]
        tree = engine.kv.prefix_cache
        while tree.match("", prompt, record_hit=False).num_tokens > 32:
            assert tree.evict(1) == 1
        assert tree.match("", prompt, record_hit=False, checkpointed=True).num_tokens == 32
        job = engine.kv.start_load("", prompt)
        assert job is not None and job.wanted is not None and job.wanted.after == 32
        engine.kv.flush()
        assert engine.kv.load_ready(job) and job.state is None
        if lost == "everything":
            engine.kv.reset_prefix_cache()
        while tree.num_checkpoints:
            assert tree.evict_checkpoint()
        restarted = engine.kv.restart_load(job)
        assert restarted is not None and restarted.wanted is not None and restarted.wanted.after == 0
        engine.kv.flush()
        admission = engine.kv.admit("", prompt, 64, load=restarted)
        assert admission is not None
        # The blocks read reach 44 tokens; the state resumes at 32 and the rest are recomputed.
        assert (admission.num_cached_tokens, admission.recomputed) == (32, 12)
        assert admission.hits.get(TIER_DISK, 0) == (32 if lost == "everything" else 0)
        engine.kv.release(admission.seq, prompt, admission.num_cached_tokens)
        engine.kv.check()
    finally:
        engine.close()
