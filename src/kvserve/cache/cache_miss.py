"""CacheMiss: why an admission computed text its namespace had seen lately, and `explain`, which says it.

A prompt's prefill is a miss when the namespace's recent-prefix index (recent_prefixes.py) saw more of
it than the cache gave: whole blocks of a prefix seen were lost, or the prompt parts from what was seen
while what was seen went on. A never-seen prompt, or one cached as far as it was seen, is no miss (and
another namespace's prompts are never seen: each has its own index).

The reasons, one per miss, first that applies:
- `no_checkpoint`: a hybrid model recomputed tokens for want of a state checkpoint (the count comes
  from the admission; 0 where the model has no recurrent state);
- `load_timeout`: the blocks were being read from a lower tier and its budget ran out;
- `tier_unavailable`: a lower tier is down (its calls fail) and memory no longer held the blocks;
- `expired`: a retention held the first lost block until it expired, then the block was evicted;
- `evicted`: memory gave the blocks up for others (and no tier below gave them back);
- `diverged`: the prompt parts from what was seen at `position`, where what was seen went on, and at
  least a block of what follows, and half of it, is text the namespace saw (found again by its chunks:
  recent_prefixes.py): a changed byte early in a prompt seen before. A prompt that parts from what was
  seen into text never seen (a new conversation over a shared system prompt) is new text.
"""

from dataclasses import dataclass

from kvserve.cache.recent_prefixes import Seen

MISS_NO_CHECKPOINT = "no_checkpoint"
MISS_LOAD_TIMEOUT = "load_timeout"
MISS_TIER_UNAVAILABLE = "tier_unavailable"
MISS_EXPIRED = "expired"
MISS_EVICTED = "evicted"
MISS_DIVERGED = "diverged"
MISS_REASONS = (
    MISS_NO_CHECKPOINT,
    MISS_LOAD_TIMEOUT,
    MISS_TIER_UNAVAILABLE,
    MISS_EXPIRED,
    MISS_EVICTED,
    MISS_DIVERGED,
)


@dataclass(frozen=True)
class CacheMiss:
    """One admission's miss: `missed_tokens` computed that were seen (lost: from the cached prefix to
    the seen one; diverged: the text after `position` the namespace saw), `cached_tokens` the cache
    gave, `seen_tokens` the prefix the namespace saw, and `position` the first token computed that
    was seen (lost) or the first that differs (diverged)."""

    reason: str
    cached_tokens: int
    missed_tokens: int
    seen_tokens: int
    position: int


@dataclass(frozen=True)
class Losses:
    """What an admission knows of where lost blocks went: tokens recomputed for want of a checkpoint,
    a load that ran out of time, a lower tier that is down, a retention that ended."""

    no_checkpoint_tokens: int = 0
    load_timed_out: bool = False
    tier_down: bool = False
    expired: bool = False


def explain(seen: Seen, limit: int, cached: int, block_size: int, losses: Losses) -> CacheMiss | None:
    """The miss of an admission that used `cached` tokens of a prompt whose first `limit` tokens it
    could use, the namespace having seen `seen`; None: no miss."""
    if losses.no_checkpoint_tokens > 0:
        n = losses.no_checkpoint_tokens
        return CacheMiss(MISS_NO_CHECKPOINT, cached, n, seen.tokens, cached)
    known = min(seen.tokens, limit)
    if known // block_size > cached // block_size:
        if losses.load_timed_out:
            reason = MISS_LOAD_TIMEOUT
        elif losses.tier_down:
            reason = MISS_TIER_UNAVAILABLE
        elif losses.expired:
            reason = MISS_EXPIRED
        else:
            reason = MISS_EVICTED
        return CacheMiss(reason, cached, known - cached, seen.tokens, cached)
    after = limit - seen.tokens
    if seen.diverged and after > 0 and seen.realigned >= block_size and 2 * seen.realigned >= after:
        missed = min(seen.realigned, after)
        return CacheMiss(MISS_DIVERGED, cached, missed, seen.tokens, seen.tokens)
    return None
