"""Greedy loops: replies that end by repeating themselves.

Small models at temperature 0 often fall into a loop: the same few lines again and again until the
token limit. A reply ends in a loop when its last 3 x p tokens are one span of p >= 8 tokens three times
back to back (LOOP_REPEATS copies of at least LOOP_MIN_SPAN tokens). A loop cut short by the token limit
still counts: the three copies are then of the span as it starts at that point. Repetition shorter than
8 tokens (a list's "1. ", "2. ") or only twice is not a loop.
"""

from collections.abc import Iterable, Sequence

from kvserve_bench.client import RequestResult
from kvserve_bench.tokens import TokenIds

LOOP_MIN_SPAN = 8
LOOP_REPEATS = 3


def loop_span(
    tokens: Sequence[int], min_span: int = LOOP_MIN_SPAN, repeats: int = LOOP_REPEATS
) -> int | None:
    """The shortest span length p >= `min_span` that the reply ends with `repeats` times in a row; None
    when it does not end in a loop."""
    n = len(tokens)
    for p in range(min_span, n // repeats + 1):
        tail = tokens[n - repeats * p :]
        if all(tail[i] == tail[i + p] for i in range(len(tail) - p)):
            return p
    return None


def mark_greedy_loops(results: Iterable[RequestResult], token_ids: TokenIds) -> None:
    """Sets `greedy_loop` on every request that got a reply, from the reply's tokens."""
    for result in results:
        if result.error is None:
            result.greedy_loop = loop_span(token_ids(result.reply)) is not None
