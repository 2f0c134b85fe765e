"""Anthropic's routes: messages and count_tokens."""

from fastapi import Request, Response

from kvserve.server.anthropic.convert import messages_plan, messages_tokens
from kvserve.server.anthropic.protocol import CountTokensRequest, MessagesRequest, TokenCount
from kvserve.server.anthropic.serving import MessagesFormat, respond_messages
from kvserve.server.core.context import Context, check_model
from kvserve.server.http.auth import cache_namespace, caller
from kvserve.server.http.routing import Routers

ROUTES = Routers()


# Anthropic's Messages API: the same path as a chat completion (one prompt, one sample), its own plan
# builder and answer shape; errors on these routes take Anthropic's shape (server/http/errors.py).
@ROUTES.api.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request, ctx: Context) -> Response:
    check_model(ctx, body.model)
    namespace = cache_namespace(request)
    tenant = caller(request).tenant.name
    with ctx.async_engine.reserve(tenant, 1, 1) as room:
        plan = await ctx.preparation.run(tenant, messages_plan, ctx, body, namespace)
        fmt = MessagesFormat(
            ctx.async_engine.tokenizer,
            plan.call_syntax,
            plan.tool_names,
            ctx.chat.reasoning,
            plan.opens_reasoning,
            tuple(body.stop_sequences or ()),
            ctx.chat.harmony,
        )
        return await respond_messages(ctx, request, fmt, plan, room, body.stream, body.diagnostics)


@ROUTES.api.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request, ctx: Context) -> TokenCount:
    """The prompt a message request with this body would prefill, in tokens."""
    check_model(ctx, body.model)
    tenant = caller(request).tenant.name
    tokens = await ctx.preparation.run(tenant, messages_tokens, ctx, body, cache_namespace(request))
    return TokenCount(input_tokens=len(tokens))
