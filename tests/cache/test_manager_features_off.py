"""The KVCacheManager with its optional features off: each is an object that does nothing (a no-cache
prefix cache, no sliding pool, no tiers, no pins), and the manager's one code path then holds exactly
what its running sequences need."""

import pytest

from kvserve.cache.loader import LoadJob
from kvserve.cache.manager import CacheConfig, KVCacheManager, PinRefused, SequenceBlocks
from kvserve.cache.no_prefix_cache import NoPrefixCache
from kvserve.cache.pins import NoPins
from kvserve.cache.sliding_pool import NoSlidingPool
from kvserve.cache.tier_loads import NoTiers

BS = 4
PROMPT = list(range(100, 100 + 5 * BS + 2))


def _serve(kv: KVCacheManager, tokens: list[int]) -> int:
    """Admit, compute and release `tokens`; the cached tokens its admission found."""
    admission = kv.admit("", tokens, budget=len(tokens))
    assert admission is not None
    kv.publish(admission.seq, tokens, len(tokens))
    kv.check()
    kv.release(admission.seq, tokens, len(tokens))
    kv.check()
    return admission.num_cached_tokens


def test_without_the_prefix_cache_nothing_outlives_its_sequence() -> None:
    kv = KVCacheManager(CacheConfig(16, BS, enable_prefix_caching=False, max_retained_blocks=8))
    assert isinstance(kv.prefix_cache, NoPrefixCache)
    assert isinstance(kv.sliding, NoSlidingPool) and isinstance(kv.tiers, NoTiers)
    assert _serve(kv, PROMPT) == 0 and _serve(kv, PROMPT) == 0
    assert kv.pool.num_free == 16 and kv.cached_prefix_len("", PROMPT) == 0
    usage = kv.usage()
    assert (usage.num_cached, usage.num_locked, usage.num_evictable, usage.tiers) == (0, 0, 0, ())
    assert kv.reset_prefix_cache() == 0 and kv.prefix_cache.hot_branches(4) == []
    # Retention and pinning need the tree: off whatever their budgets.
    assert not kv.retention_enabled and kv.retain("", PROMPT, [(len(PROMPT), 60.0)]) == [0]
    with pytest.raises(PinRefused, match="pinning is off"):
        kv.pin("", PROMPT, 60)


def test_with_the_prefix_cache_the_same_path_caches() -> None:
    kv = KVCacheManager(CacheConfig(16, BS))
    assert _serve(kv, PROMPT) == 0
    assert _serve(kv, PROMPT) == len(PROMPT) - 1
    assert kv.usage().num_cached == -(-len(PROMPT) // BS)


def test_the_no_cache_prefix_cache_keeps_nothing_it_is_given() -> None:
    none = NoPrefixCache()
    assert none.insert("", PROMPT[:8], [0, 1]) == 0
    match = none.match("", PROMPT)
    assert (match.blocks, match.num_tokens, match.partial_block) == ((), 0, None)
    assert none.evict(4) == 0 and none.evict_sliding(4) == 0 and none.num_nodes_in("") == 0
    assert none.entries() == [] and none.sliding_entries() == {}


def test_no_tiers_start_no_load_and_land_nothing() -> None:
    kv = KVCacheManager(CacheConfig(16, BS))
    assert kv.start_load("", PROMPT) is None and kv.loads_pending == 0
    tiers = NoTiers()
    job = LoadJob("", tuple(PROMPT[:8]), 0, done=True)
    assert tiers.ready(job) and tiers.restart_load(job) is None and tiers.take(job) == []
    seq = SequenceBlocks("")
    assert tiers.land(seq, PROMPT, [], {}, job) == 0 and seq.blocks == []
    assert tiers.read_now("", PROMPT, 0) == [] and tiers.usage() == ()
    kv.wait_for_loads(0.0)
    kv.flush()
    kv.close()


def test_without_pinnable_blocks_every_pin_is_refused_and_nothing_is_held() -> None:
    kv = KVCacheManager(CacheConfig(16, BS))
    assert isinstance(kv.holds.pins, NoPins)
    _serve(kv, PROMPT)
    with pytest.raises(PinRefused, match="pinning is off"):
        kv.pin("", PROMPT, 60)
    assert kv.pins("") == [] and kv.usage().num_pinned == 0
    kv.check()
    pinning = KVCacheManager(CacheConfig(16, BS, max_pinned_blocks=8))
    _serve(pinning, PROMPT)
    assert pinning.pin("", PROMPT, 60) is not None
    pinning.check()


def test_the_config_refuses_a_sliding_pool_without_its_window_or_a_pool_all_pinned() -> None:
    with pytest.raises(ValueError, match="needs its window"):
        KVCacheManager(CacheConfig(16, BS, num_sliding_blocks=4))
    with pytest.raises(ValueError, match="needs its window"):
        KVCacheManager(CacheConfig(16, BS, sliding_window=8))
    with pytest.raises(ValueError, match="unpinned"):
        KVCacheManager(CacheConfig(16, BS, max_pinned_blocks=16))
