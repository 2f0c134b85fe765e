"""OpenAI's routes: chat and text completions, models, tokenize and detokenize."""

from fastapi import Request, Response

from kvserve.engine.validation import check_vocabulary
from kvserve.errors import InvalidRequestError
from kvserve.server.core.context import Context, check_model
from kvserve.server.core.prompts import chat_prompt, prompt_batch, text_prompt
from kvserve.server.http.auth import cache_namespace, caller
from kvserve.server.http.routing import Routers
from kvserve.server.openai.convert import chat_completion_plan, completion_plan
from kvserve.server.openai.formats import ChatFormat, CompletionFormat
from kvserve.server.openai.logprobs import LogprobRenderer
from kvserve.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    SamplingRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from kvserve.server.openai.serving import respond
from kvserve.server.openai.unsupported import check_chat, check_completion

ROUTES = Routers()


@ROUTES.keyed.get("/v1/models")
async def models(ctx: Context) -> ModelList:
    return ModelList(
        data=[ModelCard(id=ctx.model_name, created=ctx.created, max_model_len=ctx.max_model_len)]
    )


def _include_usage(body: SamplingRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


# A request's route checks what its body alone decides, reserves room in the engine's queue for all its
# sequences before any work (the door refuses what is over the cap or cannot fit), then builds its plan
# in one trip off the event loop: templating, tokenizing, a vocabulary-wide logit_bias and a grammar's
# compile all grow with the request, and the loop serves every stream. The trip is a preparation job of
# the caller's tenant (server/core/preparation.py): one tenant's slow preparations never queue another's.
@ROUTES.api.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, ctx: Context) -> Response:
    check_model(ctx, body.model)
    check_chat(body)
    namespace = cache_namespace(request, body.cache_salt)
    tenant = caller(request).tenant.name
    with ctx.async_engine.reserve(tenant, 1, body.n) as room:
        plan = await ctx.preparation.run(tenant, chat_completion_plan, ctx, body, namespace)
        fmt = ChatFormat(
            LogprobRenderer(ctx.async_engine.tokenizer),
            body.logprobs,
            plan.call_syntax,
            ctx.chat.reasoning,
            plan.opens_reasoning,
            plan.tool_names,
            ctx.chat.harmony,
        )
        return await respond(
            ctx, request, fmt, plan, room, body.stream, _include_usage(body), body.kvserve_cache_report
        )


@ROUTES.api.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, ctx: Context) -> Response:
    check_model(ctx, body.model)
    check_completion(body)
    fmt = CompletionFormat(LogprobRenderer(ctx.async_engine.tokenizer), body.logprobs is not None, body.echo)
    namespace = cache_namespace(request, body.cache_salt)
    # A batch's size is known from the body alone, before anything is done per prompt.
    num_prompts = len(prompt_batch(body.prompt))
    tenant = caller(request).tenant.name
    with ctx.async_engine.reserve(tenant, num_prompts, body.n) as room:
        plan = await ctx.preparation.run(tenant, completion_plan, ctx, body, namespace)
        return await respond(
            ctx, request, fmt, plan, room, body.stream, _include_usage(body), body.kvserve_cache_report
        )


@ROUTES.api.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request, ctx: Context) -> TokenizeResponse:
    check_model(ctx, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError(
            "Send either 'prompt' (a string) or 'messages' (a chat), not both or neither."
        )
    if body.messages is not None:
        namespace = cache_namespace(request, body.cache_salt)
        tokens = await ctx.preparation.run(
            caller(request).tenant.name,
            chat_prompt,
            ctx.async_engine,
            ctx.prompt_guard,
            body.messages,
            namespace,
            body.add_generation_prompt,
            None,
            ctx.chat,
        )
    else:
        prompt = body.prompt or ""
        ctx.prompt_guard.check([prompt], "prompt")
        tokens = await ctx.preparation.run(
            caller(request).tenant.name,
            text_prompt,
            ctx.async_engine.tokenizer,
            prompt,
            body.add_special_tokens,
        )
    return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=ctx.max_model_len)


@ROUTES.api.post("/detokenize")
async def detokenize(body: DetokenizeRequest, ctx: Context) -> DetokenizeResponse:
    check_model(ctx, body.model)
    tokenizer = ctx.async_engine.tokenizer
    check_vocabulary(tokenizer.vocab_size, body.tokens, "tokens")
    # Special tokens are kept so that detokenize(tokenize(text)) gives the text back.
    return DetokenizeResponse(prompt=tokenizer.decode(body.tokens, skip_special_tokens=False))
