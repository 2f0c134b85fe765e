"""Pinning over HTTP: compute a prefix if needed, pin it, unpin it.

A pin passes the same guards as a completion: in the route, an in-flight slot, pinning on before any
work, and its plan (`pin_plan`: the prompt-length guard before tokenizing, tokenizing and the
engine's check of the token ids off the event loop, before the engine sees them).
"""

from kvserve.cache.manager import PinRefused
from kvserve.engine.sampling_params import SamplingParams
from kvserve.errors import InvalidRequestError
from kvserve.server.cache_api.protocol import PinInfo, PinRequest
from kvserve.server.cache_api.views import pin_info
from kvserve.server.core.context import ServerContext
from kvserve.server.core.plan import RequestPlan, plan_prompts
from kvserve.server.core.prompts import chat_prompt, text_prompt
from kvserve.server.http.errors import APIError

# Computing the prefix and pinning it are two engine calls; traffic in between may evict what was just
# computed (without a disk tier to find it again), so the pair is tried a few times.
_PIN_ATTEMPTS = 3
# A pin computes its prefix with one generated token, which leaves the whole prompt's KV in the cache.
PIN_PREFILL = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def pin_plan(ctx: ServerContext, body: PinRequest, namespace: str) -> RequestPlan:
    """A pin's plan: the prefix to pin (rendered chat messages without the generation prompt, tokenized
    text or the ids given) as one prompt, with the params that compute its KV if it is not cached."""
    if body.messages is not None:
        token_ids = chat_prompt(
            ctx.async_engine, ctx.prompt_guard, body.messages, namespace, False, setup=ctx.chat
        )
    elif isinstance(body.prompt, str):
        ctx.prompt_guard.check([body.prompt], "prompt")
        token_ids = text_prompt(ctx.async_engine.tokenizer, body.prompt)
    else:
        token_ids = list(body.prompt or [])
    return plan_prompts(ctx, [token_ids], PIN_PREFILL, namespace)


def check_pinning_on(ctx: ServerContext) -> None:
    """A clear 400 on a server started without --max-pinned-tokens (or without a prefix cache)."""
    if not ctx.async_engine.pinning_enabled:
        raise InvalidRequestError(
            "Pinning is off on this server: start it with --max-pinned-tokens (and the prefix cache on).",
            code="pinning_disabled",
        )


async def pin_prefix(ctx: ServerContext, tenant: str, plan: RequestPlan, ttl_s: float) -> PinInfo:
    """Pin the plan's one prompt, computing its KV first (the plan's one sample) when it is not all
    cached."""
    async_engine = ctx.async_engine
    (prompt,), (prefill,) = plan.prompts, plan.samples
    for _ in range(_PIN_ATTEMPTS):
        try:
            pinned = await async_engine.pin(plan.namespace, prompt.token_ids, ttl_s)
        except PinRefused as e:
            raise InvalidRequestError(f"Cannot pin this prefix: {e}.") from None
        if pinned is not None:
            return pin_info(pinned)
        async for _ in async_engine.generate(prompt.checked, prefill, plan.namespace, tenant=tenant):
            pass
    raise APIError(
        503,
        "The prefix was evicted before it could be pinned; the server is under memory pressure, retry.",
        "server_error",
        code="pin_unavailable",
    )


async def unpin(ctx: ServerContext, namespace: str, pin_id: str) -> None:
    if not await ctx.async_engine.unpin(namespace, pin_id):
        raise APIError(
            404, f"No pin '{pin_id}' in this cache namespace.", param="pin_id", code="pin_not_found"
        )
