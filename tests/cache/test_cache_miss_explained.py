"""A miss explained: the recent-prefix index and the manager's `explain`, each reason produced on purpose."""

import random
import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.cache.cache_miss import (
    MISS_DIVERGED,
    MISS_EVICTED,
    MISS_EXPIRED,
    MISS_LOAD_TIMEOUT,
    MISS_NO_CHECKPOINT,
    MISS_TIER_UNAVAILABLE,
    CacheMiss,
    Losses,
    explain,
)
from kvserve.cache.manager import CacheConfig, KVCacheManager
from kvserve.cache.recent_prefixes import RecentPrefixes, Seen, entry_bytes

BS = 4


def run(kv: KVCacheManager, namespace: str, tokens: list[int]) -> None:
    """Admit `tokens` whole, compute them and release them (as a finished request would)."""
    admission = kv.admit(namespace, tokens, len(tokens))
    assert admission is not None
    kv.publish(admission.seq, tokens, len(tokens))
    kv.release(admission.seq, tokens, len(tokens))


def admit_and_explain(kv: KVCacheManager, namespace: str, tokens: list[int]) -> CacheMiss | None:
    admission = kv.admit(namespace, tokens, len(tokens))
    assert admission is not None
    miss = kv.explain(namespace, tokens, admission)
    kv.release(admission.seq, tokens, 0)
    return miss


def test_the_index_finds_the_token_where_a_prompt_parts_from_what_was_seen() -> None:
    index = RecentPrefixes(BS)
    seen = list(range(1000, 1200))
    index.remember("a", seen)
    assert index.seen("a", seen) == Seen(200)
    # One token changed at 13: the rest is found again by its chunks.
    changed = index.seen("a", [*seen[:13], 7, *seen[14:]])
    assert (changed.tokens, changed.diverged) == (13, True) and changed.realigned >= 150
    # Five tokens inserted at 40: the chunks after them are found whatever they shifted by.
    inserted = index.seen("a", [*seen[:40], 1, 2, 3, 4, 5, *seen[40:]])
    assert (inserted.tokens, inserted.diverged) == (40, True) and inserted.realigned >= 120
    # Parting into text never seen: diverged, with nothing found again.
    assert index.seen("a", [*seen[:20], *range(5000, 5180)]).realigned < 16
    # A prompt that goes on past what was seen parts from nothing: new text.
    assert index.seen("a", [*seen, 1, 2, 3]) == Seen(200)
    # Another namespace saw nothing.
    assert index.seen("b", seen) == Seen(0)


def test_explain_orders_the_reasons() -> None:
    lost = Seen(40)
    assert explain(lost, 49, 8, BS, Losses()).reason == MISS_EVICTED  # type: ignore[union-attr]
    assert explain(lost, 49, 8, BS, Losses(expired=True)).reason == MISS_EXPIRED  # type: ignore[union-attr]
    assert explain(lost, 49, 8, BS, Losses(tier_down=True)).reason == MISS_TIER_UNAVAILABLE  # type: ignore[union-attr]
    timed_out = explain(lost, 49, 8, BS, Losses(tier_down=True, load_timed_out=True))
    assert timed_out is not None and timed_out.reason == MISS_LOAD_TIMEOUT and timed_out.missed_tokens == 32
    checkpoint = explain(lost, 49, 40, BS, Losses(no_checkpoint_tokens=12))
    assert (
        checkpoint is not None and checkpoint.reason == MISS_NO_CHECKPOINT and checkpoint.missed_tokens == 12
    )
    # Cached as far as it was seen: no miss; never seen: no miss.
    assert explain(lost, 49, 40, BS, Losses()) is None
    assert explain(Seen(0), 49, 0, BS, Losses(tier_down=True)) is None
    # Diverged at 10 with 30 of the 39 tokens after it seen: missed; with 8 seen, new text.
    diverged = explain(Seen(10, True, 30), 49, 8, BS, Losses())
    assert diverged is not None and diverged.reason == MISS_DIVERGED and diverged.missed_tokens == 30
    assert explain(Seen(10, True, 8), 49, 8, BS, Losses()) is None


def test_the_manager_says_diverged_and_never_crosses_namespaces() -> None:
    kv = KVCacheManager(CacheConfig(num_blocks=256, block_size=BS))
    prompt = list(range(100, 300))
    run(kv, "a", prompt)
    # The same prompt again: cached as far as it was seen; another namespace's is never seen.
    assert admit_and_explain(kv, "a", prompt) is None
    assert admit_and_explain(kv, "b", prompt) is None
    # A token changed at 9: diverged there, the rest seen.
    miss = admit_and_explain(kv, "a", [*prompt[:9], 5, *prompt[10:]])
    assert miss is not None and miss.reason == MISS_DIVERGED and miss.position == 9
    assert miss.missed_tokens >= 150


def test_the_manager_says_evicted_and_expired() -> None:
    now = [0.0]
    kv = KVCacheManager(
        CacheConfig(num_blocks=12, block_size=BS, max_retained_blocks=8, max_retained_blocks_per_namespace=8),
        clock=lambda: now[0],
    )
    prompt = list(range(100, 121))
    run(kv, "a", prompt)
    # A flood evicts it.
    for i in range(6):
        run(kv, "c", [1000 + 50 * i + t for t in range(20)])
    miss = admit_and_explain(kv, "a", prompt)
    assert miss is not None and miss.reason == MISS_EVICTED and miss.missed_tokens == 20 - miss.cached_tokens
    # Retained, expired, evicted: expired.
    run(kv, "a", prompt)
    kv.retain("a", prompt, [(20, 5.0)])
    now[0] = 10.0
    assert kv.expire_retentions() == 1
    for i in range(6):
        run(kv, "c", [3000 + 50 * i + t for t in range(20)])
    miss = admit_and_explain(kv, "a", prompt)
    assert miss is not None and miss.reason == MISS_EXPIRED


@settings(max_examples=25, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.lists(st.integers(0, 2**31), min_size=40, max_size=200)),
        min_size=8,
        max_size=40,
    )
)
def test_the_index_stays_under_its_bounds_under_a_flood_of_unique_prompts(
    prompts: list[tuple[int, list[int]]],
) -> None:
    names = [f"t{n}" for n in range(6)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = RecentPrefixes(BS, max_entries_per_namespace=32, max_entries=80)
    for namespace, tokens in prompts:
        index.remember(names[namespace], tokens)
        index.check()
        assert all(index.num_entries_in(n) <= 32 for n in names)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert index.num_entries <= 80
    # Its memory: at most 80 keys of at most 260 bytes each, and a table per namespace present.
    assert used <= 80 * 260 + 6 * 1024 + 4096, used


def test_the_index_memory_per_namespace_is_bounded_by_its_entries() -> None:
    """The measure the docs cite: bytes per key of a full namespace (8,192 keys), at 16 tokens a block."""
    index = RecentPrefixes(16, max_entries_per_namespace=8192, max_entries=8192)
    rng = random.Random(0)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(1200):
        index.remember("t", [rng.randrange(50000) for _ in range(16 * 8)] + [i])
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert index.num_entries_in("t") == 8192
    assert entry_bytes(16) == 33
    # A key (int), a value (bytes of at most 33, or the shared empty one of a chunk key), and the ordered
    # dict's slot for them: about 201 bytes measured.
    assert used / 8192 < 260, used / 8192
