"""A pin on a sliding-window model holds its prefix's last window of sliding blocks: however short the
sliding pool runs, the pinned prefix stays usable, and unpinning lets it be tombstoned again."""

from kvserve.cache.manager import RELEASED, CacheConfig, KVCacheManager
from kvserve.cache.sliding_pool import SlidingPool

BS = 4
WINDOW = 6


def _cached(kv: KVCacheManager, tokens: list[int]) -> None:
    """Compute `tokens` in one sequence and release it: its blocks stay cached."""
    admission = kv.admit("", tokens, budget=len(tokens))
    assert admission is not None and admission.num_cached_tokens == 0
    kv.publish(admission.seq, tokens, len(tokens))
    kv.release(admission.seq, tokens, len(tokens))


def test_a_pinned_prefix_keeps_its_window_through_sliding_eviction() -> None:
    config = CacheConfig(32, BS, max_pinned_blocks=8, num_sliding_blocks=16, sliding_window=WINDOW)
    kv = KVCacheManager(config)
    cache, sliding = kv.prefix_cache, kv.sliding
    assert isinstance(sliding, SlidingPool)
    prompt = list(range(100, 100 + 6 * BS))
    _cached(kv, prompt)
    pin = kv.pin("", prompt, ttl_s=60)
    assert pin is not None
    # The window of the next token after 24 reads positions 19..23: blocks 4 and 5.
    assert len(pin.sliding) == 2 and RELEASED not in pin.sliding
    kv.check()
    assert cache.evict_sliding(16) == 4
    kv.check()
    assert cache.match("", [*prompt, 1]).num_tokens == len(prompt)
    assert kv.unpin("", pin.pin_id)
    assert cache.evict_sliding(16) == 2
    assert cache.match("", [*prompt, 1]).num_tokens == 0
    kv.check()
    assert sliding.num_used == 0
