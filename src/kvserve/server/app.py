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
from kvserve.server.auth import authenticate, cache_namespace, caller
from kvserve.server.errors import APIError, install_error_handlers
from kvserve.server.limits import (
    DEFAULT_MAX_IN_FLIGHT_PER_TENANT,
    DEFAULT_MAX_REQUEST_BYTES,
    BodySizeLimit,
    InFlightLimiter,
    PromptGuard,
)
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
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
from kvserve.server.tenants import Tenants, load_or_create_secret

log = logging.getLogger("kvserve.server")

# On SIGTERM, in-flight requests get this long to finish before their connections are cut.
GRACEFUL_SHUTDOWN_S = 30
# /health fails if the engine thread does not answer within this long (a step can take seconds on a CPU).
HEALTH_TIMEOUT_S = 10


def _context(request: Request) -> ServerContext:
    context: ServerContext = request.app.state.context
    return context


Context = Annotated[ServerContext, Depends(_context)]


def _authenticate(request: Request, ctx: Context) -> None:
    authenticate(request, ctx.tenants)


async def _in_flight_slot(request: Request, ctx: Context) -> AsyncIterator[None]:
    # Async so that it runs on the event loop, the limiter's only thread; exits once the response has
    # been sent, a stream included.
    with ctx.in_flight.slot(caller(request).tenant.name):
        yield


public = APIRouter()
api = APIRouter(dependencies=[Depends(_authenticate)])
InFlight = Depends(_in_flight_slot)


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


@api.post("/v1/chat/completions", dependencies=[InFlight])
async def chat_completions(body: ChatCompletionRequest, request: Request, ctx: Context) -> Response:
    check_model(ctx, body.model)
    namespace = cache_namespace(request, body.cache_salt)
    # Templating and tokenizing a long chat takes a while: off the event loop, which serves every stream.
    prompt = await asyncio.to_thread(chat_prompt, ctx, body.messages, namespace)
    max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    params = sampling_params(body, max_tokens)
    return await respond(ctx, request, ChatFormat(), prompt, params, namespace, body)


@api.post("/v1/completions", dependencies=[InFlight])
async def completions(body: CompletionRequest, request: Request, ctx: Context) -> Response:
    check_model(ctx, body.model)
    if isinstance(body.prompt, str):
        ctx.prompt_guard.check([body.prompt], "prompt")
    prompt = await asyncio.to_thread(text_prompt, ctx.async_engine.tokenizer, body.prompt)
    params = sampling_params(body, body.max_tokens)
    namespace = cache_namespace(request, body.cache_salt)
    return await respond(ctx, request, CompletionFormat(), prompt, params, namespace, body)


@api.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request, ctx: Context) -> TokenizeResponse:
    check_model(ctx, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "Send either 'prompt' (a string) or 'messages' (a chat), not both or neither.")
    if body.messages is not None:
        namespace = cache_namespace(request, body.cache_salt)
        tokens = await asyncio.to_thread(
            chat_prompt, ctx, body.messages, namespace, body.add_generation_prompt
        )
    else:
        prompt = body.prompt or ""
        ctx.prompt_guard.check([prompt], "prompt")
        tokens = await asyncio.to_thread(
            text_prompt, ctx.async_engine.tokenizer, prompt, body.add_special_tokens
        )
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


def create_app(
    async_engine: AsyncEngine,
    api_key: str | None = None,
    tenants: Tenants | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_in_flight_per_tenant: int = DEFAULT_MAX_IN_FLIGHT_PER_TENANT,
) -> FastAPI:
    """The HTTP app around a running AsyncEngine; the app owns it and shuts it down when it stops.

    `tenants` defaults to one tenant: `api_key`'s, or everyone when it is None."""
    engine = async_engine.engine
    if tenants is None:
        tenants = Tenants(load_or_create_secret(engine.config.cache_dir), api_key)
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
        openapi_url="/openapi.json" if tenants.single_tenant else None,
    )
    app.state.context = ServerContext(
        async_engine=async_engine,
        model_name=name,
        max_model_len=engine.max_model_len,
        metrics=ServerMetrics(name),
        tenants=tenants,
        created=int(time.time()),
        in_flight=InFlightLimiter(max_in_flight_per_tenant),
        prompt_guard=PromptGuard(engine.max_model_len, engine.tokenizer.max_token_chars()),
    )
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    install_error_handlers(app)
    app.include_router(public)
    app.include_router(api)
    return app


def serve(
    config: EngineConfig,
    host: str,
    port: int,
    api_key: str | None,
    max_waiting: int,
    api_key_file: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_in_flight_per_tenant: int = DEFAULT_MAX_IN_FLIGHT_PER_TENANT,
) -> int:
    """Load the model, then serve until SIGINT or SIGTERM: stop accepting, let in-flight requests end
    (for up to GRACEFUL_SHUTDOWN_S), stop the engine. SIGHUP re-reads the key file."""
    # Keys first: a bad key file fails in a second, not after the model has loaded.
    tenants = Tenants(load_or_create_secret(config.cache_dir), api_key, api_key_file)
    log.info("tenancy: %s", tenants.describe())
    tenants.install_sighup_reload()
    engine = Engine(dataclasses.replace(config, max_waiting=max_waiting))
    async_engine = AsyncEngine(engine)
    app = create_app(
        async_engine,
        tenants=tenants,
        max_request_bytes=max_request_bytes,
        max_in_flight_per_tenant=max_in_flight_per_tenant,
    )
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
