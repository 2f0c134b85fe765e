"""The whole engine under random workloads and configs, token for token against a no-cache engine.

Workloads mix shared system prompts, multi-turn chains, exact repeats, two namespaces, staggered arrivals,
aborts at any point (mid-prefill, mid-decode), n > 1 samples of one prompt, requests constrained by a
regex or a choice (structured outputs: their grammar state must follow the tokens through preemption and
cache hits alike), and requests for prompt logprobs (which compute every prompt position whatever the
cache holds, and must equal the no-cache engine's), seeded sampling (a seeded sample must be as
cache-transparent as a greedy one), stop strings, EOS (made likely by a logit_bias) and the three
penalties; configs range over block sizes 1..32, pools from one
that barely fits the largest request to large ones, token budgets from 1, 1..64 sequences, both
attention backends (the reference runs the portable one), the disk tier on or off (with the
tiny pools, most of its cases evict and load blocks back from disk) and the Redis tier on or off (a real
redis-server, emptied for each case; below the disk when both are on), and the KV dtype: the compute
dtype or q8_0 (whose blocks the tiers store as they are; on a tiny Llama with heads of 32, against a
no-cache engine with a q8_0 cache too). With a lower tier, memory may
also be dropped every few steps, so that most admissions wait in the loading state while the loader
reads their blocks (n samples of one prompt loading together, aborts while loading). Every step
checks the cache manager's accounting; every case ends with no leak and with a sample of the tree's
blocks holding exactly the KV of their tokens. A cache that never hits would pass all that, so every
case also checks its hits: a request that repeats a finished one's prompt (a block or more of it, in the
same namespace, with nothing evicted) finds it cached, and with the cache off nothing is.

The same cases run on sliding-window models (`test_sliding_window_engine_matches_a_no_cache_engine`):
every layer sliding or global and sliding layers mixed, windows of one token, inside a block, of exactly
one block and of several, block sizes down to 1, prompts many windows long; each against a no-cache
engine on the same model. Most of them run over two pools, the sliding layers' own beside the global one,
with the cache on as with it off: the sliding pool is the factory's split, as tight as one request's
window and chunk allows, so that cached prefixes are tombstoned and matches cut back at tombstones
(`KVCacheManager.check()` after every step). A match past a tombstone is rarely drawn here: skipping
the cut-back passes these examples, and the tree's state machine
(`tests/cache/test_prefix_cache_radix_tree_state_machine.py`, its sliding machine) is what fails.

`make test` runs a fixed (derandomized) set of examples (150 of the whole engine, 75 sliding, 50 across the
families); `KVSERVE_LONG_TESTS=1` (or
`KVSERVE_DIFFERENTIAL_EXAMPLES=5000`) runs a longer, randomized search for nightly use.
"""

import functools
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvserve.engine.engine import Engine
from kvserve.engine.grammar import StructuredOutputs
from kvserve.model.loader import LoadedModel
from tests.harness import (
    MAX_MODEL_LEN,
    OracleDrafter,
    Run,
    Spec,
    assert_cached_kv_is_fresh,
    assert_matches_reference,
    assert_no_leak,
    drive,
    engine_with_blocks,
    reference_outputs,
)
from tests.model.family_cases import FAMILY_KINDS
from tests.redis_server import RedisServer

_NIGHTLY = os.environ.get("KVSERVE_DIFFERENTIAL_EXAMPLES") or (
    "5000" if os.environ.get("KVSERVE_LONG_TESTS") == "1" else None
)
EXAMPLES = int(_NIGHTLY) if _NIGHTLY else 300
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=_NIGHTLY is None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

REDIS_SECRET = bytes(range(32))


@dataclass
class Case:
    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_prefix_caching: bool
    attention: str
    disk_tier: bool
    redis_tier: bool
    # With a lower tier: drop memory's unheld blocks every that many steps (None: never).
    drop_memory_every: int | None
    systems: list[list[int]]
    specs: list[Spec]
    # A sliding-window model (conftest.SLIDING_KINDS kind, window), or None for the tiny Llama.
    sliding: tuple[str, int] | None = None
    # The KV cache's dtype: "auto" (the compute dtype) or q8_0 (on the tiny Llama with heads of 32).
    kv_dtype: str = "auto"
    # Speculation: "off", "suffix" (the engine's drafter) or "oracle" (tests.harness.OracleDrafter,
    # mostly right drafts, seeded by `oracle_seed`), and the draft tokens a decode may verify.
    speculative: str = "off"
    speculative_tokens: int = 8
    oracle_seed: int = 0
    # Hybrid models: the state checkpoint interval (0: the structural ones only) and the checkpoints the
    # cache may keep (tiny: they are evicted).
    state_checkpoint_interval: int = 0
    state_checkpoints: int = 256
    # The weights: float32 (the float64 runs), or q8_0 in float32 on the native path, whose steps (prefill
    # chunks too) run in the one-call native decoder.
    weights: str = "float32"


# A small alphabet makes accidental shared prefixes and partial-block hits common.
_token = st.one_of(st.integers(100, 103), st.integers(100, 4095))
_tokens = st.lists(_token, max_size=24)


# Constrained requests: their grammars steer the tiny model's output, and must do so alike whatever
# the cache holds (grammars whose text needs no token past the tiny model's 4,096).
_CONSTRAINTS = [
    StructuredOutputs(regex=r"[a-f0-9 ]{1,12}"),
    StructuredOutputs(choice=["a", "b c", "d e f g"]),
]


# The tiny model's EOS token (tests/helpers.py). Its flat logits put EOS near the top: small biases make
# EOS come at varied points (from the first token on), greedy or sampled.
_EOS = 2


@st.composite
def samplings(draw: st.DrawFn) -> dict[str, Any]:
    """SamplingParams fields over greedy's: most requests stay greedy, the rest mix the options."""
    out: dict[str, Any] = {}
    if draw(st.integers(0, 3)) == 0:
        out |= {"temperature": draw(st.sampled_from([0.6, 1.0, 1.8])), "seed": draw(st.integers(0, 2**16))}
    if draw(st.integers(0, 4)) == 0:
        out["stop"] = draw(st.lists(st.sampled_from(["e", "in", " a", "."]), min_size=1, max_size=2))
    if draw(st.integers(0, 4)) == 0:
        out |= {"ignore_eos": False, "logit_bias": {_EOS: draw(st.sampled_from([0.2, 0.4, 0.8, 2.0]))}}
    if draw(st.integers(0, 4)) == 0:
        out |= {
            "presence_penalty": draw(st.sampled_from([-1.0, 0.0, 1.5])),
            "frequency_penalty": draw(st.sampled_from([0.0, 0.7, 2.0])),
            "repetition_penalty": draw(st.sampled_from([1.0, 0.8, 1.6])),
        }
    return out


@st.composite
def cases(draw: st.DrawFn, sliding: bool = False, kv_dtypes: bool = False) -> Case:
    """A workload and an engine config; `sliding`: on a sliding-window model, whose window is drawn
    against the block size (smaller, equal, several blocks); `kv_dtypes`: the KV dtype drawn too."""
    block_size = draw(st.sampled_from([1, 2, 4, 8] if sliding else [1, 2, 4, 8, 16, 32]))
    systems = draw(st.lists(st.lists(_token, min_size=1, max_size=48), min_size=1, max_size=3))
    specs: list[Spec] = []
    for i in range(draw(st.integers(1, 10))):
        kinds = ["system"] + (["repeat", "follow"] if i else [])
        kind = draw(st.sampled_from(kinds))
        k = draw(st.integers(0, len(systems) - 1)) if kind == "system" else draw(st.integers(0, i - 1))
        specs.append(
            Spec(
                base=(kind, k),
                suffix=draw(_tokens),
                max_tokens=draw(st.integers(1, 8)),
                arrival=draw(st.integers(0, 12)),
                abort_after=draw(st.one_of(st.none(), st.integers(0, 12))),
                namespace=draw(st.sampled_from(["", "", "", "other"])),
                n=draw(st.sampled_from([1, 1, 1, 1, 2, 3])),
                prompt_logprobs=draw(st.sampled_from([False, False, False, True])),
                constraint=draw(st.sampled_from([None, None, None, *_CONSTRAINTS])),
                sampling=draw(samplings()),
            )
        )
    enable_prefix_caching = draw(st.booleans()) or draw(st.booleans())
    disk_tier = enable_prefix_caching and draw(st.booleans())
    redis_tier = enable_prefix_caching and draw(st.booleans())
    # From a pool that barely holds one request (prompts are clipped to fit it) up to a roomy one; with
    # the disk tier the pool stays tiny, so that blocks are evicted and loaded back.
    lower = disk_tier or redis_tier
    capacity = draw(st.integers(8, 40 if lower else 160))
    spare = draw(st.sampled_from([0, 1] if lower else [0, 0, 1, 3, 40]))
    num_blocks = -(-capacity // block_size) + spare
    return Case(
        block_size=block_size,
        num_blocks=min(num_blocks, MAX_MODEL_LEN),
        max_num_batched_tokens=draw(st.one_of(st.integers(1, 6), st.integers(7, 300))),
        max_num_seqs=draw(st.one_of(st.integers(1, 3), st.integers(4, 64))),
        enable_prefix_caching=enable_prefix_caching,
        attention=draw(st.sampled_from(["native", "torch"])),
        disk_tier=disk_tier,
        redis_tier=redis_tier,
        drop_memory_every=draw(st.sampled_from([None, 1, 2, 5])) if lower else None,
        systems=systems,
        specs=specs,
        sliding=(draw(st.sampled_from(["all", "hybrid"])), draw(st.sampled_from([1, 2, 3, 4, 8, 13])))
        if sliding
        else None,
        kv_dtype=draw(st.sampled_from(["auto", "auto", "q8_0"])) if kv_dtypes else "auto",
        speculative=draw(st.sampled_from(["off", "suffix", "oracle", "oracle"])),
        speculative_tokens=draw(st.sampled_from([1, 2, 3, 8, 64])),
        oracle_seed=draw(st.integers(0, 2**16)),
        # Every token, one block, several blocks, or only the structural checkpoints.
        state_checkpoint_interval=draw(st.sampled_from([1, block_size, 3 * block_size, 0])),
        state_checkpoints=draw(st.sampled_from([1, 2, 5, 256])),
    )


pytestmark = pytest.mark.usefixtures("one_thread")


def _common_prefix(a: list[int], b: list[int]) -> int:
    # Written apart from the cache's own helper, which it checks.
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _last_checkpoint(case: Case, prompt_j: list[int], shared: int) -> int:
    """A hybrid model's: the last position at or before `shared` where request j's prefill surely left a
    state checkpoint (its prompt's end and the token before it, every interval's multiple)."""
    at = [p for p in (len(prompt_j) - 1, len(prompt_j)) if p <= shared]
    if case.state_checkpoint_interval:
        at.append(shared // case.state_checkpoint_interval * case.state_checkpoint_interval)
    return max(at, default=0)


def assert_repeats_hit(case: Case, run: Run, lost: int, hybrid: bool = False) -> None:
    """Where a hit is certain, it happened: request i repeats (or follows) request j, j ended normally
    before i was submitted, i asked for no prompt logprobs (which run uncached), both share a namespace
    and i's prompt begins with at least a whole block plus one token of j's prompt (on a `hybrid` model,
    up to a checkpoint j left a whole block or more in, and within whole blocks where memory is dropped),
    and nothing was evicted or tombstoned. With the cache off, nothing hits."""
    if not case.enable_prefix_caching:
        assert all(n == 0 for n in run.cached.values()), run.cached
        return
    if lost:
        return
    for i, spec in enumerate(case.specs):
        kind, j = spec.base
        if kind == "system" or i in run.aborted or j in run.aborted or spec.prompt_logprobs:
            continue
        if spec.namespace != case.specs[j].namespace:
            continue
        shared = min(_common_prefix(run.prompts[i], run.prompts[j]), len(run.prompts[i]) - 1)
        if hybrid:
            if case.drop_memory_every:
                # Memory may be gone: the tiers give back whole blocks only, and a checkpoint within them.
                shared = shared // case.block_size * case.block_size
            shared = _last_checkpoint(case, run.prompts[j], shared)
        if shared >= case.block_size:
            assert run.cached[(i, 0)] >= case.block_size, (i, j, shared, run.cached[(i, 0)])


@pytest.fixture(scope="module")
def reference(tiny_model: LoadedModel) -> Engine:
    # The portable attention path, so that cases on the native kernel are checked against the other one.
    return engine_with_blocks(
        tiny_model, 1024, 16, enable_prefix_caching=False, attention="torch", speculative="off"
    )


@pytest.fixture(scope="module")
def q8_reference(tiny_q8_model: LoadedModel) -> Engine:
    return engine_with_blocks(
        tiny_q8_model,
        1024,
        16,
        enable_prefix_caching=False,
        attention="torch",
        kv_dtype="q8_0",
        speculative="off",
    )


# Half the base count by default: its 300 examples were the suite's slowest test (130 s on 2 busy cores).
@settings(SETTINGS, max_examples=EXAMPLES if _NIGHTLY else EXAMPLES // 2)
@given(case=cases(kv_dtypes=True))
def test_engine_matches_a_no_cache_engine_token_for_token(
    tiny_model: LoadedModel,
    reference: Engine,
    tiny_q8_model: LoadedModel,
    q8_reference: Engine,
    redis_session: RedisServer,
    case: Case,
) -> None:
    if case.kv_dtype == "q8_0":
        check_case(tiny_q8_model, q8_reference, redis_session, case)
    else:
        check_case(tiny_model, reference, redis_session, case)


@pytest.fixture(scope="module")
def decoder_reference(tiny_model: LoadedModel) -> Engine:
    """The no-cache engine on q8_0 weights in float32, op by op: its native decoder detached."""
    engine = engine_with_blocks(
        tiny_model,
        1024,
        16,
        enable_prefix_caching=False,
        attention="native",
        speculative="off",
        dtype="float32",
        weight_dtype="q8_0",
    )
    assert engine.runner.transformer.decoder is not None
    engine.runner.transformer.decoder = None
    return engine


@settings(SETTINGS, max_examples=max(EXAMPLES // 8, 1))
@given(case=cases())
def test_native_decoder_engine_matches_a_per_op_no_cache_engine(
    tiny_model: LoadedModel, decoder_reference: Engine, redis_session: RedisServer, case: Case
) -> None:
    """Every step of the tiny Llama on native products and attention runs in the one-call decoder
    (prompts, chunks and drafts too), with the prefix cache, its tiers and speculation as drawn: token
    for token what the per-op path gives each request alone (float32: the native path's rows keep their
    bits in any batch)."""
    check_case(
        tiny_model, decoder_reference, redis_session, replace(case, attention="native", weights="q8_0")
    )


@pytest.fixture(scope="module")
def sliding_references(sliding_model: Callable[[str, int], LoadedModel]) -> Callable[[str, int], Engine]:
    """The no-cache engine on each sliding model (portable attention), made on first use."""
    engines: dict[tuple[str, int], Engine] = {}

    def get(kind: str, window: int) -> Engine:
        if (kind, window) not in engines:
            model = sliding_model(kind, window)
            engines[kind, window] = engine_with_blocks(
                model, 1024, 16, enable_prefix_caching=False, attention="torch", speculative="off"
            )
        return engines[kind, window]

    return get


@settings(SETTINGS, max_examples=max(EXAMPLES // 4, 1))
@given(case=cases(sliding=True))
def test_sliding_window_engine_matches_a_no_cache_engine(
    sliding_model: Callable[[str, int], LoadedModel],
    sliding_references: Callable[[str, int], Engine],
    redis_session: RedisServer,
    case: Case,
) -> None:
    assert case.sliding is not None
    check_case(sliding_model(*case.sliding), sliding_references(*case.sliding), redis_session, case)


@pytest.fixture(scope="module")
def family_references(family_model: Callable[[str], LoadedModel]) -> Callable[[str], Engine]:
    """The no-cache engine on each family's model (portable attention), made on first use."""
    engines: dict[str, Engine] = {}

    def get(kind: str) -> Engine:
        if kind not in engines:
            engines[kind] = engine_with_blocks(
                family_model(kind),
                1024,
                16,
                enable_prefix_caching=False,
                attention="torch",
                speculative="off",
            )
        return engines[kind]

    return get


@settings(SETTINGS, max_examples=max(EXAMPLES // 6, len(FAMILY_KINDS)))
@given(case=cases(), kind=st.sampled_from(sorted(FAMILY_KINDS)))
def test_each_family_matches_a_no_cache_engine(
    family_model: Callable[[str], LoadedModel],
    family_references: Callable[[str], Engine],
    redis_session: RedisServer,
    case: Case,
    kind: str,
) -> None:
    check_case(family_model(kind), family_references(kind), redis_session, case)


# Cases that once failed, each run first: a load restarted after memory lost its checkpoint kept its
# stale state lookup and missed a certain hit; a repeat shorter than the prompt it repeats has no
# checkpoint to hit, nor has a checkpoint inside a block the tiers cannot give back once memory is
# dropped (the check once counted both as certain).
_TINY = functools.partial(
    Case,
    block_size=1,
    num_blocks=8,
    max_num_batched_tokens=1,
    max_num_seqs=1,
    enable_prefix_caching=True,
    attention="native",
    speculative="off",
    state_checkpoints=5,
)
_HYBRID_EXAMPLES = [
    _TINY(
        disk_tier=False,
        redis_tier=True,
        drop_memory_every=2,
        systems=[[100]],
        specs=[Spec(("system", 0), [], 1), Spec(("repeat", 0), [100, 100], 1)],
        state_checkpoint_interval=1,
    ),
    _TINY(
        disk_tier=True,
        redis_tier=False,
        drop_memory_every=2,
        systems=[[100] * 7],
        specs=[Spec(("system", 0), [], 1), Spec(("repeat", 0), [], 2)],
        state_checkpoint_interval=0,
    ),
    _TINY(
        block_size=2,
        num_blocks=4,
        disk_tier=False,
        redis_tier=True,
        drop_memory_every=2,
        systems=[[100] * 6],
        specs=[Spec(("system", 0), [], 1), Spec(("system", 0), [], 1), Spec(("repeat", 0), [], 1)],
        state_checkpoint_interval=6,
    ),
]


@settings(SETTINGS, max_examples=max(EXAMPLES // 8, 1))
@given(case=cases())
@example(case=_HYBRID_EXAMPLES[0])
@example(case=_HYBRID_EXAMPLES[1])
def test_hybrid_model_matches_a_no_cache_engine(
    family_model: Callable[[str], LoadedModel],
    family_references: Callable[[str], Engine],
    redis_session: RedisServer,
    case: Case,
) -> None:
    """LFM2's hybrid (recurrent state beside attention): state checkpoints at every interval drawn,
    tiny checkpoint pools that evict, speculation on and off, lower tiers (which carry checkpoints too:
    with memory dropped every few steps, most hits resume from a checkpoint read back from a tier)."""
    check_case(family_model("lfm2-hybrid"), family_references("lfm2-hybrid"), redis_session, case)


def check_case(model: LoadedModel, reference: Engine, redis_session: RedisServer, case: Case) -> None:
    """Run `case` on a fresh engine on `model` and check it against `reference`, its hits, its leaks
    and a sample of its cached blocks."""
    if case.redis_tier:
        client = redis_session.client()
        client.flushall()
        client.close()
    with tempfile.TemporaryDirectory(prefix="kvserve-disk-") as disk:
        engine = engine_with_blocks(
            model,
            case.num_blocks,
            case.block_size,
            max_num_batched_tokens=case.max_num_batched_tokens,
            max_num_seqs=case.max_num_seqs,
            enable_prefix_caching=case.enable_prefix_caching,
            attention=case.attention,
            kv_dtype=case.kv_dtype,
            speculative="off" if case.speculative == "off" else "suffix",
            speculative_tokens=case.speculative_tokens,
            kv_disk=disk if case.disk_tier else None,
            kv_remote=redis_session.url if case.redis_tier else None,
            secret=REDIS_SECRET,
            state_checkpoint_interval=case.state_checkpoint_interval,
            state_checkpoints=case.state_checkpoints,
            **({} if case.weights == "float32" else {"dtype": "float32", "weight_dtype": case.weights}),
        )
        oracle = None
        if case.speculative == "oracle":
            oracle = OracleDrafter(reference, case.oracle_seed)
            engine.scheduler.drafter = oracle
        try:
            run = drive(
                engine, case.systems, case.specs, drop_memory_every=case.drop_memory_every, oracle=oracle
            )
            assert_matches_reference(run, reference_outputs(reference, run))
            tree = engine.kv.prefix_cache
            # A tombstoned sliding block makes a hit ending inside its window impossible, as an eviction does.
            lost = engine.stats().cache.num_evicted + (tree.num_tombstoned if tree is not None else 0)
            # A hybrid model's hit needs a checkpoint: one evicted, skipped or given up loses it.
            lost += engine.kv.checkpoint_misses + getattr(tree, "num_checkpoints_evicted", 0)
            assert_repeats_hit(case, run, lost, hybrid=engine.kv.states.enabled)
            assert_no_leak(engine)
            if case.enable_prefix_caching:
                assert_cached_kv_is_fresh(engine, model, sample=6)
        finally:
            engine.close()


@settings(SETTINGS, max_examples=max(EXAMPLES // 8, 1))
@given(case=cases())
@example(case=_HYBRID_EXAMPLES[2])
def test_qwen3_5_matches_a_no_cache_engine(
    family_model: Callable[[str], LoadedModel],
    family_references: Callable[[str], Engine],
    redis_session: RedisServer,
    case: Case,
) -> None:
    check_case(family_model("qwen3_5-hybrid"), family_references("qwen3_5-hybrid"), redis_session, case)
