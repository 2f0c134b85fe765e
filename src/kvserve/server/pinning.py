"""Pinning over HTTP: compute a prefix if needed, pin it, unpin it.

A pin passes the same guards as a completion (in the route: an in-flight slot; here: pinning on before
any work, the prompt-length guard before tokenizing, tokenizing off the event loop, token ids within
the vocabulary before the engine sees them).
"""

import asyncio

from kvserve.cache.manager import PinRefused
from kvserve.engine.sampling_params import SamplingParams
from kvserve.server.cache_views import pin_info
from kvserve.server.context import ServerContext
from kvserve.server.errors import APIError
from kvserve.server.prompts import chat_prompt, check_token_ids, text_prompt
from kvserve.server.protocol import PinInfo, PinRequest

# Computing the prefix and pinning it are two engine calls; traffic in between may evict what was just
# computed (without a disk tier to find it again), so the pair is tried a few times.
_PIN_ATTEMPTS = 3


def check_pinning_on(ctx: ServerContext) -> None:
    """A clear 400 on a server started without --max-pinned-tokens (or without a prefix cache)."""
    if not ctx.async_engine.pinning_enabled:
        raise APIError(
            400,
            "Pinning is off on this server: start it with --max-pinned-tokens (and the prefix cache on).",
            code="pinning_disabled",
        )


async def pin_tokens(ctx: ServerContext, body: PinRequest, namespace: str) -> list[int]:
    """The token ids of the prefix to pin: rendered chat messages, tokenized text or the ids given."""
    tokenizer = ctx.async_engine.tokenizer
    if body.messages is not None:
        # chat_prompt guards the messages' length before rendering them.
        tokens = await asyncio.to_thread(chat_prompt, ctx, body.messages, namespace, False)
    elif isinstance(body.prompt, str):
        ctx.prompt_guard.check([body.prompt], "prompt")
        tokens = await asyncio.to_thread(text_prompt, tokenizer, body.prompt)
    else:
        tokens = list(body.prompt or [])
        # The engine's bound: ids it can embed (a model may have more than its tokenizer).
        await asyncio.to_thread(check_token_ids, ctx.async_engine.vocab_size, [tokens])
    if not tokens:
        raise APIError(400, "The prefix to pin is empty.", param="prompt")
    return tokens


async def pin_prefix(
    ctx: ServerContext, namespace: str, tenant: str, tokens: list[int], ttl_s: float
) -> PinInfo:
    async_engine = ctx.async_engine
    for _ in range(_PIN_ATTEMPTS):
        try:
            pinned = await async_engine.pin(namespace, tokens, ttl_s)
        except PinRefused as e:
            raise APIError(400, f"Cannot pin this prefix: {e}.") from None
        if pinned is not None:
            return pin_info(pinned)
        # One generated token leaves the whole prompt's KV in the cache.
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        async for _ in async_engine.generate(tokens, params, namespace, tenant=tenant):
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
