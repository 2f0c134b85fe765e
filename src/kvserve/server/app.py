"""The FastAPI app: routes, lifespan, `create_app` around an AsyncEngine, and `serve` for the CLI."""

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Annotated

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvserve import __version__
from kvserve.config import EngineConfig
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.server.auth import cache_namespace, check_api_key
from kvserve.server.errors import APIError, install_error_handlers
from kvserve.server.metrics import ServerMetrics
from kvserve.server.pinning import cache_status, pin_prefix, unpin
from kvserve.server.protocol import (
    CacheStatus,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    PinDeleted,
    PinInfo,
    PinRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from kvserve.server.serving import (
    ChatFormat,
    CompletionFormat,
    ServerContext,
    chat_prompt,
    check_model,
    respond,
    sampling_params,
    text_prompt,
)

log = logging.getLogger("kvserve.server")

# On SIGTERM, in-flight requests get this long to finish before their connections are cut.
GRACEFUL_SHUTDOWN_S = 30
# /health fails if the engine thread does not answer within this long (a step can take seconds on a CPU).
HEALTH_TIMEOUT_S = 10


def _context(request: Request) -> ServerContext:
    context: ServerContext = request.app.state.context
    return context


Context = Annotated[ServerContext, Depends(_context)]


def _require_api_key(request: Request, ctx: Context) -> None:
    check_api_key(request, ctx.api_key)


public = APIRouter()
api = APIRouter(dependencies=[Depends(_require_api_key)])


@public.get("/health")
async def health(ctx: Context) -> Response:
    if ctx.async_engine.failure is not None:
        raise APIError(503, f"The {ctx.async_engine.failure}.", "server_error", code="engine_failed")
    try:
        await asyncio.wait_for(ctx.async_engine.call(lambda engine: None), HEALTH_TIMEOUT_S)
    except TimeoutError as e:
        raise APIError(503, "The engine is not answering.", "server_error", code="engine_unavailable") from e
    return Response(status_code=200)


@api.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@api.get("/v1/models")
async def models(ctx: Context) -> ModelList:
    return ModelList(
        data=[ModelCard(id=ctx.model_name, created=ctx.created, max_model_len=ctx.max_model_len)]
    )


@api.get("/metrics")
async def metrics(ctx: Context) -> Response:
    return Response(await ctx.metrics.exposition(ctx.async_engine), media_type=CONTENT_TYPE_LATEST)


@api.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, ctx: Context) -> Response:
    check_model(ctx, body.model)
    namespace = cache_namespace(request)
    prompt = chat_prompt(ctx, body.messages, namespace)
    max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    params = sampling_params(body, max_tokens)
    return await respond(ctx, request, ChatFormat(), prompt, params, namespace, body)


@api.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, ctx: Context) -> Response:
    check_model(ctx, body.model)
    prompt = text_prompt(ctx.async_engine.tokenizer, body.prompt)
    params = sampling_params(body, body.max_tokens)
    return await respond(ctx, request, CompletionFormat(), prompt, params, cache_namespace(request), body)


@api.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request, ctx: Context) -> TokenizeResponse:
    check_model(ctx, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "Send either 'prompt' (a string) or 'messages' (a chat), not both or neither.")
    if body.messages is not None:
        tokens = chat_prompt(ctx, body.messages, cache_namespace(request), body.add_generation_prompt)
    else:
        tokens = text_prompt(ctx.async_engine.tokenizer, body.prompt or "", body.add_special_tokens)
    return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=ctx.max_model_len)


@api.post("/detokenize")
async def detokenize(body: DetokenizeRequest, ctx: Context) -> DetokenizeResponse:
    check_model(ctx, body.model)
    tokenizer = ctx.async_engine.tokenizer
    bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise APIError(
            400, f"Token ids must be in [0, {tokenizer.vocab_size}); got {bad[:5]}.", param="tokens"
        )
    # Special tokens are kept so that detokenize(tokenize(text)) gives the text back.
    return DetokenizeResponse(prompt=tokenizer.decode(body.tokens, skip_special_tokens=False))


@api.post("/v1/cache/pin")
async def pin(body: PinRequest, request: Request, ctx: Context) -> PinInfo:
    check_model(ctx, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(
            400, "Send either 'prompt' (text or token ids) or 'messages' (a chat), not both or neither."
        )
    namespace = cache_namespace(request)
    if body.messages is not None:
        tokens = chat_prompt(ctx, body.messages, namespace, add_generation_prompt=False)
    else:
        tokens = text_prompt(ctx.async_engine.tokenizer, body.prompt or "")
    if not tokens:
        raise APIError(400, "The prefix to pin is empty.", param="prompt")
    return await pin_prefix(ctx, namespace, tokens, body.ttl_s)


@api.delete("/v1/cache/pin/{pin_id}")
async def delete_pin(pin_id: str, request: Request, ctx: Context) -> PinDeleted:
    await unpin(ctx, cache_namespace(request), pin_id)
    return PinDeleted(id=pin_id)


@api.get("/v1/cache")
async def cache(request: Request, ctx: Context) -> CacheStatus:
    return await cache_status(ctx, cache_namespace(request))


def create_app(async_engine: AsyncEngine, api_key: str | None = None) -> FastAPI:
    """The HTTP app around a running AsyncEngine; the app owns it and shuts it down when it stops."""
    engine = async_engine.engine
    name = engine.model.name

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        # Runs after the server stopped accepting and in-flight requests ended (or were cut off).
        async_engine.shutdown()

    # With a key set, every route but /health needs it; the generated docs would be the exception.
    app = FastAPI(
        title="kvserve",
        version=__version__,
        lifespan=lifespan,
        openapi_url=None if api_key else "/openapi.json",
    )
    app.state.context = ServerContext(
        async_engine=async_engine,
        model_name=name,
        max_model_len=engine.max_model_len,
        metrics=ServerMetrics(name),
        api_key=api_key,
        created=int(time.time()),
    )
    install_error_handlers(app)
    app.include_router(public)
    app.include_router(api)
    return app


def serve(config: EngineConfig, host: str, port: int, api_key: str | None, max_waiting: int) -> int:
    """Load the model, then serve until SIGINT or SIGTERM: stop accepting, let in-flight requests end
    (for up to GRACEFUL_SHUTDOWN_S), stop the engine."""
    engine = Engine(dataclasses.replace(config, max_waiting=max_waiting))
    async_engine = AsyncEngine(engine)
    app = create_app(async_engine, api_key)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            # kvserve's logging setup applies, and the server writes its own line per request.
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
    )

    def stop_on_engine_failure(error: BaseException) -> None:
        # Runs on the engine thread; uvicorn polls should_exit, then lets the failed responses go out.
        server.should_exit = True

    async_engine.on_failure = stop_on_engine_failure
    with suppress(KeyboardInterrupt):
        server.run()
    if async_engine.failure is not None:
        log.error("exiting because the engine failed: %s", async_engine.failure)
        return 1
    return 0 if server.started else 1
