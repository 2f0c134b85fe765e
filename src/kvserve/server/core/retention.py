"""Retention over HTTP: a request's prompt-cache breakpoints (Anthropic's `cache_control`, block-level or
top-level) hold the prefix up to each against eviction for its TTL (cache/retention.py has the rules).

A route calls `retain_breakpoints` once a request's prompt is computed (after its prefill, or when it
completes), with each breakpoint as (prefix tokens, TTL seconds). It costs one engine call, none when
there is nothing to hold or retention is off (the prefix cache off, or --max-retained 0), and it never
fails a request: a breakpoint past the prompt, under a block or with a TTL that is not positive holds
nothing.
"""

from collections.abc import Sequence

from kvserve.server.core.context import ServerContext


async def retain_breakpoints(
    ctx: ServerContext, namespace: str, token_ids: Sequence[int], breakpoints: Sequence[tuple[int, float]]
) -> list[int]:
    """Hold the prompt `token_ids` of `namespace` (the request's cache namespace) up to each breakpoint
    (length, ttl_s) for its TTL, refreshing a retention of the same prefix; returns the tokens of each
    breakpoint's prefix held once all are made (0: none; a prefix is held in whole blocks, within the
    namespace's budget, as far as memory still caches it): what usage reports as kept."""
    if not breakpoints or not ctx.async_engine.retention_enabled:
        return [0] * len(breakpoints)
    return await ctx.async_engine.retain(namespace, token_ids, breakpoints)
