"""Pinning over HTTP: compute a prefix if needed, pin it, list pins and tier usage per namespace.

A pin passes the same guards as a completion (in the route: an in-flight slot; here: pinning on before
any work, the prompt-length guard before tokenizing, tokenizing off the event loop, token ids within
the vocabulary before the engine sees them).
"""

import asyncio
import time

from kvserve.cache.manager import CacheUsage, Pin, PinRefused
from kvserve.engine.engine import Engine
from kvserve.engine.sampling_params import SamplingParams
from kvserve.server.errors import APIError
from kvserve.server.protocol import CacheStatus, PinInfo, PinRequest, TierInfo
from kvserve.server.serving import ServerContext, chat_prompt, check_token_ids, text_prompt

# Computing the prefix and pinning it are two engine calls; traffic in between may evict what was just
# computed (without a disk tier to find it again), so the pair is tried a few times.
_PIN_ATTEMPTS = 3


def _info(engine: Engine, pin: Pin) -> PinInfo:
    left = max(0.0, pin.expires_at - engine.kv.clock())
    return PinInfo(
        id=pin.pin_id,
        pinned_tokens=len(pin.tokens),
        expires_at=int(time.time() + left),
        expires_in_s=round(left, 3),
    )


def check_pinning_on(ctx: ServerContext) -> None:
    """A clear 400 on a server started without --max-pinned-tokens (or without a prefix cache)."""
    engine = ctx.async_engine.engine
    if not engine.config.enable_prefix_caching or engine.kv.max_pinned_blocks == 0:
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
        vocab = ctx.async_engine.engine.model.config.vocab_size
        await asyncio.to_thread(check_token_ids, vocab, [tokens])
    if not tokens:
        raise APIError(400, "The prefix to pin is empty.", param="prompt")
    return tokens


async def pin_prefix(
    ctx: ServerContext, namespace: str, tenant: str, tokens: list[int], ttl_s: float
) -> PinInfo:
    async_engine = ctx.async_engine

    def pin(engine: Engine) -> PinInfo | None:
        found = engine.pin(namespace, tokens, ttl_s)
        return None if found is None else _info(engine, found)

    for _ in range(_PIN_ATTEMPTS):
        try:
            info: PinInfo | None = await async_engine.call(pin)
        except PinRefused as e:
            raise APIError(400, f"Cannot pin this prefix: {e}.") from None
        if info is not None:
            return info
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
    if not await ctx.async_engine.call(lambda e: e.unpin(namespace, pin_id)):
        raise APIError(
            404, f"No pin '{pin_id}' in this cache namespace.", param="pin_id", code="pin_not_found"
        )


async def cache_status(ctx: ServerContext, namespace: str) -> CacheStatus:
    def status(engine: Engine) -> CacheStatus:
        usage = engine.kv.usage()
        bs = engine.config.block_size
        memory = TierInfo(
            name="memory",
            blocks=usage.num_cached,
            bytes_used=usage.num_cached * engine.bytes_per_block,
            capacity_bytes=usage.num_blocks * engine.bytes_per_block,
            pinned_blocks=usage.num_pinned,
            max_pinned_blocks=usage.max_pinned,
        )
        lower = lower_tiers(usage)
        pins = [_info(engine, p) for p in engine.pins(namespace)]
        return CacheStatus(block_size=bs, pins=pins, tiers=[memory, *lower])

    result: CacheStatus = await ctx.async_engine.call(status)
    return result


def lower_tiers(usage: CacheUsage) -> list[TierInfo]:
    """The tiers below memory (the disk), as `GET /v1/cache` and the dashboard show them."""
    return [
        TierInfo(name=t.name, blocks=t.num_blocks, bytes_used=t.bytes_used, capacity_bytes=t.capacity_bytes)
        for t in usage.tiers
    ]
