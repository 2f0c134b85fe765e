"""Retention over HTTP: a request's prompt-cache breakpoints (Anthropic's `cache_control`, block-level or
top-level; OpenAI's cache fields, server/core/prompt_cache.py) hold the prefix up to each against
eviction for its TTL (cache/retention.py has the rules).

A route calls `retain_breakpoints` once a request's prompt is computed (after its prefill, or when it
completes), with each breakpoint as (prefix tokens, TTL seconds). It costs one engine call, none when
there is nothing to hold or retention is off (the prefix cache off, or --max-retained 0), and it never
fails a request: a breakpoint past the prompt, under a block or with a TTL that is not positive holds
nothing.
"""

from collections.abc import Sequence

from kvserve.server.core.context import ServerContext
from kvserve.server.core.output import Choice
from kvserve.server.core.plan import RequestPlan


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


async def retain_plan(ctx: ServerContext, plan: RequestPlan) -> int:
    """Hold each of the plan's breakpoints (its one prompt's) once its reply is out; how many of the
    prompt's first tokens the retentions now hold."""
    if not plan.breakpoints:
        return 0
    breakpoints = [(b.tokens, b.ttl_s) for b in plan.breakpoints]
    held = await retain_breakpoints(ctx, plan.namespace, plan.prompts[0].token_ids, breakpoints)
    return max(held, default=0)


def written_tokens(choice: Choice, kept: int) -> int:
    """What the request computed and its retentions keep: the first `kept` tokens past the cached ones
    (Anthropic's cache_creation_input_tokens, OpenAI's cache_write_tokens)."""
    return max(0, min(kept, choice.outputs.num_prompt_tokens) - choice.outputs.num_cached_tokens)
