"""The FastAPI app: routes, lifespan, `create_app` around an AsyncEngine, and `serve` for the CLI."""

import asyncio
import dataclasses
import gc
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Annotated

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import CONTENT_TYPE_LATEST

from kvserve import __version__
from kvserve.config import EngineConfig
from kvserve.credentials import identity_proof, read_kv_remote_password, url_with_password
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.engine.validation import check_vocabulary
from kvserve.errors import InvalidRequestError
from kvserve.model.heap import release_startup_pages
from kvserve.options import ServerOptions
from kvserve.secret import read_secret
from kvserve.server.anthropic.convert import messages_plan, messages_tokens
from kvserve.server.anthropic.protocol import CountTokensRequest, MessagesRequest, TokenCount
from kvserve.server.anthropic.serving import MessagesFormat, respond_messages
from kvserve.server.cache_api.dashboard import ASSETS, CacheStatsResponse, Dashboard, StatsHistory, asset
from kvserve.server.cache_api.pins import check_pinning_on, pin_plan, pin_prefix, unpin
from kvserve.server.cache_api.protocol import CacheStatus, PinDeleted, PinInfo, PinRequest
from kvserve.server.cache_api.views import cache_status
from kvserve.server.core.chat_setup import chat_setup, read_chat_template
from kvserve.server.core.context import ServerContext, check_model
from kvserve.server.core.preparation import PreparationPool
from kvserve.server.core.prompts import PromptGuard, chat_prompt, prompt_batch, text_prompt
from kvserve.server.http.auth import ADMIN_TENANT, cache_namespace, caller, stats_scope
from kvserve.server.http.errors import APIError, install_error_handlers
from kvserve.server.http.json_body import JSONBounds, bounded_route
from kvserve.server.http.metrics import ServerMetrics
from kvserve.server.http.middleware import Access, InFlightLimiter, RequestGate, route_access
from kvserve.server.http.request_id import RequestIdMiddleware
from kvserve.server.http.tenants import Tenants, load_or_create_secret
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
from kvserve.server.responses.persist import DiskBackend, RedisBackend
from kvserve.server.responses.protocol import InputItemList, ResponseDeleted, ResponsesRequest
from kvserve.server.responses.serving import item_list, respond_responses, unknown_response
from kvserve.server.responses.serving import prepare as prepare_response
from kvserve.server.responses.store import Backend, ResponseStore, StoreLimits

log = logging.getLogger("kvserve.server")

# /health fails if the engine thread does not answer within this long (a step can take seconds on a CPU).
HEALTH_TIMEOUT_S = 10


def _context(request: Request) -> ServerContext:
    context: ServerContext = request.app.state.context
    return context


Context = Annotated[ServerContext, Depends(_context)]


def _response_store(request: Request) -> ResponseStore:
    """The Responses API's stored responses: its own state, beside the context every route shares."""
    store: ResponseStore = request.app.state.responses
    return store


Stored = Annotated[ResponseStore, Depends(_response_store)]


# Each router's routes ask one access of their callers, checked by the gate (server/http/middleware.py)
# before the app reads a byte of the body: `api`'s take a key and one of its tenant's in-flight slots,
# and parse their bodies with bounds (server/http/json_body.py).
public = APIRouter()
keyed = APIRouter()
api = APIRouter(route_class=bounded_route(JSONBounds()))
admin = APIRouter()
ROUTERS = ((public, Access.OPEN), (keyed, Access.KEY), (api, Access.TENANT), (admin, Access.ADMIN))


@public.get("/health")
async def health(ctx: Context) -> Response:
    if ctx.async_engine.failure is not None:
        raise APIError(503, f"The {ctx.async_engine.failure}.", "server_error", code="engine_failed")
    try:
        # Shielded: a timeout must not cancel the call's future, which the engine thread completes later.
        await asyncio.wait_for(asyncio.shield(ctx.async_engine.ping()), HEALTH_TIMEOUT_S)
    except TimeoutError as e:
        raise APIError(503, "The engine is not answering.", "server_error", code="engine_unavailable") from e
    return Response(status_code=200)


# A challenge of 16 to 64 random bytes, in hex.
_CHALLENGE_HEX = r"^([0-9a-fA-F]{2}){16,64}$"


# Open, as /health is (the launcher may hold no tenant key), and useless without the nonce: only a
# server that `kvserve cluster` started with one has it (ServerOptions.launch_nonce).
@public.get("/identity", include_in_schema=False)
async def identity(
    ctx: Context, challenge: Annotated[str, Query(pattern=_CHALLENGE_HEX)]
) -> dict[str, object]:
    nonce = ctx.options.launch_nonce
    if nonce is None:
        raise APIError(404, "This server was not started by `kvserve cluster`.", code="not_found")
    pid = os.getpid()
    return {"pid": pid, "proof": identity_proof(nonce, bytes.fromhex(challenge), pid)}


@keyed.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@keyed.get("/v1/models")
async def models(ctx: Context) -> ModelList:
    return ModelList(
        data=[ModelCard(id=ctx.model_name, created=ctx.created, max_model_len=ctx.max_model_len)]
    )


# Every tenant's rows (names, cached tokens request by request): the operator's view, so the admin key's
# once the server has keys (see check_admin_key).
@admin.get("/metrics")
async def metrics(ctx: Context) -> Response:
    return Response(await ctx.metrics.exposition(ctx.async_engine), media_type=CONTENT_TYPE_LATEST)


@admin.post("/reset_prefix_cache")
async def reset_prefix_cache(ctx: Context) -> dict[str, int]:
    """Drop every cached block no request is using (as vLLM's route does, for benchmark clients)."""
    return {"freed_blocks": await ctx.async_engine.reset_prefix_cache()}


def _include_usage(body: SamplingRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


# A request's route checks what its body alone decides, reserves room in the engine's queue for all its
# sequences before any work (the door refuses what is over the cap or cannot fit), then builds its plan
# in one trip off the event loop: templating, tokenizing, a vocabulary-wide logit_bias and a grammar's
# compile all grow with the request, and the loop serves every stream. The trip is a preparation job of
# the caller's tenant (server/core/preparation.py): one tenant's slow preparations never queue another's.
@api.post("/v1/chat/completions")
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
            ctx.chat.tools.layout if body.tools else None,
            ctx.chat.reasoning,
            plan.opens_reasoning,
            plan.tool_names,
        )
        return await respond(ctx, request, fmt, plan, room, body.stream, _include_usage(body))


@api.post("/v1/completions")
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
        return await respond(ctx, request, fmt, plan, room, body.stream, _include_usage(body))


# The Responses API: its own converter (server/responses/convert.py) over chat's prompt, tools and
# constraints, and its own writer (server/responses/serving.py); its stored responses are the tenant's alone.
@api.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request, ctx: Context, store: Stored) -> Response:
    check_model(ctx, body.model)
    namespace = cache_namespace(request)
    tenant = caller(request).tenant.name
    with ctx.async_engine.reserve(tenant, 1, 1) as room:
        prepared = await ctx.preparation.run(tenant, prepare_response, ctx, store, body, namespace, tenant)
        return await respond_responses(ctx, store, request, body, prepared, room, tenant)


@api.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request, ctx: Context, store: Stored) -> Response:
    tenant = caller(request).tenant.name
    stored = await ctx.preparation.run(tenant, store.get, tenant, response_id)
    if stored is None:
        raise unknown_response(response_id)
    # The very bytes the POST answered: nothing is parsed or written on the event loop.
    return Response(stored.response, media_type="application/json")


@api.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request, ctx: Context, store: Stored) -> ResponseDeleted:
    tenant = caller(request).tenant.name
    if not await ctx.preparation.run(tenant, store.delete, tenant, response_id):
        raise unknown_response(response_id)
    return ResponseDeleted(id=response_id)


@api.get("/v1/responses/{response_id}/input_items", response_model=InputItemList)
async def response_input_items(
    response_id: str,
    request: Request,
    ctx: Context,
    store: Stored,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
    after: Annotated[str | None, Query(max_length=256)] = None,
) -> Response:
    tenant = caller(request).tenant.name
    page = await ctx.preparation.run(tenant, item_list, store, tenant, response_id, limit, order, after)
    if page is None:
        raise unknown_response(response_id)
    return Response(page, media_type="application/json")


# Anthropic's Messages API: the same path as a chat completion (one prompt, one sample), its own plan
# builder and answer shape; errors on these routes take Anthropic's shape (server/http/errors.py).
@api.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request, ctx: Context) -> Response:
    check_model(ctx, body.model)
    namespace = cache_namespace(request)
    tenant = caller(request).tenant.name
    with ctx.async_engine.reserve(tenant, 1, 1) as room:
        plan = await ctx.preparation.run(tenant, messages_plan, ctx, body, namespace)
        fmt = MessagesFormat(
            ctx.async_engine.tokenizer,
            ctx.chat.tools.layout if plan.tool_names is not None else None,
            plan.tool_names,
            ctx.chat.reasoning,
            plan.opens_reasoning,
            tuple(body.stop_sequences or ()),
        )
        return await respond_messages(ctx, request, fmt, plan, room, body.stream)


@api.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request, ctx: Context) -> TokenCount:
    """The prompt a message request with this body would prefill, in tokens."""
    check_model(ctx, body.model)
    tenant = caller(request).tenant.name
    tokens = await ctx.preparation.run(tenant, messages_tokens, ctx, body, cache_namespace(request))
    return TokenCount(input_tokens=len(tokens))


@api.get("/v1/cache/stats")
async def cache_stats(request: Request, ctx: Context) -> CacheStatsResponse:
    """The prefix cache and the requests now, and the counters' history (the dashboard's data): all
    namespaces for the admin key (or a server without keys), only its own for a tenant's key."""
    dashboard: Dashboard = request.app.state.dashboard
    namespace = stats_scope(request)

    def label(namespace: str) -> str:
        return ctx.tenants.label(namespace, [ADMIN_TENANT])

    if namespace is None:
        return await dashboard.stats(ctx.async_engine, ctx.model_name, label=label)
    totals = ctx.metrics.tenant_prefix_cache_totals(caller(request).tenant.name)
    return await dashboard.stats(ctx.async_engine, ctx.model_name, namespace, totals, label)


# The page and its scripts are a static shell with no data in them: everything shown comes from
# /v1/cache/stats, which needs a key when keys are set (the page asks for one on a 401).
@public.get("/dashboard")
async def dashboard_page() -> Response:
    return Response(asset("dashboard.html"), media_type="text/html")


@public.get("/dashboard/{name}")
async def dashboard_asset(name: str) -> Response:
    if name not in ASSETS:
        raise APIError(404, f"No dashboard file {name!r}.", code="not_found")
    return Response(asset(name), media_type=ASSETS[name])


@api.post("/tokenize")
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


@api.post("/detokenize")
async def detokenize(body: DetokenizeRequest, ctx: Context) -> DetokenizeResponse:
    check_model(ctx, body.model)
    tokenizer = ctx.async_engine.tokenizer
    check_vocabulary(tokenizer.vocab_size, body.tokens, "tokens")
    # Special tokens are kept so that detokenize(tokenize(text)) gives the text back.
    return DetokenizeResponse(prompt=tokenizer.decode(body.tokens, skip_special_tokens=False))


@api.post("/v1/cache/pin")
async def pin(body: PinRequest, request: Request, ctx: Context) -> PinInfo:
    check_model(ctx, body.model)
    # First, so that a server with pinning off does no work for a pin.
    check_pinning_on(ctx)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError(
            "Send either 'prompt' (text or token ids) or 'messages' (a chat), not both or neither."
        )
    plan = await ctx.preparation.run(
        caller(request).tenant.name, pin_plan, ctx, body, cache_namespace(request)
    )
    return await pin_prefix(ctx, caller(request).tenant.name, plan, body.ttl_s)


@api.delete("/v1/cache/pin/{pin_id}")
async def delete_pin(pin_id: str, request: Request, ctx: Context) -> PinDeleted:
    await unpin(ctx, cache_namespace(request), pin_id)
    return PinDeleted(id=pin_id)


@api.get("/v1/cache")
async def cache(request: Request, ctx: Context) -> CacheStatus:
    whole_pool = stats_scope(request) is None
    return cache_status(await ctx.async_engine.cache_view(cache_namespace(request), whole_pool))


def response_backend(config: EngineConfig, limits: StoreLimits) -> Backend | None:
    """Where stored responses outlive the process: the Redis that replicas share (--kv-remote), else
    the disk tier's folder (--kv-disk), sealed under the engine's secret (the cache folder's when none
    was given, as the engine's own tiers take it)."""
    if config.kv_remote is None and config.kv_disk is None:
        return None
    secret = config.secret if config.secret is not None else load_or_create_secret(config.cache_dir)
    if config.kv_remote is not None:
        return RedisBackend(config.kv_remote, secret)
    assert config.kv_disk is not None
    return DiskBackend(config.kv_disk, secret, limits.ttl_s)


def create_app(async_engine: AsyncEngine, options: ServerOptions, tenants: Tenants | None = None) -> FastAPI:
    """The HTTP app around a running AsyncEngine; the app owns it and shuts it down when it stops.

    `tenants` defaults to one tenant: `options.api_key`'s, or everyone when it is None (`serve` passes
    the tenants of the key file). `options.admin_key` opens the admin routes and the whole dashboard.
    Prompts x n of one request are bounded by the engine's `max_sequences_per_request`."""
    if tenants is None:
        tenants = Tenants(
            load_or_create_secret(async_engine.config.cache_dir), options.api_key, admin_key=options.admin_key
        )
    elif options.admin_key is not None:
        tenants.set_admin_key(options.admin_key)
    names = options.served_model_name or (async_engine.model_name,)
    name = names[0]
    chat = chat_setup(
        async_engine.tokenizer,
        read_chat_template(options.chat_template),
        options.tool_call_format,
        options.reasoning_parser,
    )
    limits = StoreLimits(
        options.responses_max_stored,
        options.responses_max_stored_bytes,
        options.responses_ttl_s,
        options.responses_max_total_bytes,
    )
    dashboard = Dashboard(StatsHistory.empty(), options.dashboard_show_text)
    preparation = PreparationPool(options.preparation_threads, options.max_preparing_per_tenant)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sampler = asyncio.create_task(dashboard.history.run(async_engine))
        yield
        sampler.cancel()
        # Runs after the server stopped accepting and in-flight requests ended (or were cut off).
        preparation.close()
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
        model_names=frozenset(names),
        max_model_len=async_engine.max_model_len,
        metrics=ServerMetrics(name),
        tenants=tenants,
        created=int(time.time()),
        options=options,
        in_flight=InFlightLimiter(options.max_in_flight_per_tenant),
        prompt_guard=PromptGuard(async_engine.max_model_len, async_engine.tokenizer.max_token_chars()),
        preparation=preparation,
        chat=chat,
    )
    app.state.responses = ResponseStore(limits, response_backend(async_engine.config, limits))
    app.state.dashboard = dashboard
    install_error_handlers(app)
    for router, _ in ROUTERS:
        app.include_router(router)
    # Inside CORS, so that its refusals carry CORS headers and preflights never reach it.
    app.add_middleware(
        RequestGate,
        access=route_access(ROUTERS),
        tenants=tenants,
        in_flight=app.state.context.in_flight,
        max_bytes=options.max_request_bytes,
    )
    if options.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(options.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id"],
        )
    # Outermost, so that every response carries the id, errors and CORS preflights included.
    app.add_middleware(RequestIdMiddleware)
    return app


def serve(config: EngineConfig, options: ServerOptions) -> int:
    """Load the model, then serve until SIGINT or SIGTERM: stop accepting, let in-flight requests end
    (for up to `options.shutdown_grace_s`, --shutdown-grace), stop the engine. SIGHUP re-reads the key file.

    The engine runs under the tenants' secret (`options.tenant_secret_file`, default the cache folder's)
    and with `options.kv_remote`, which ServerOptions accepts only with a secret file, given its password
    (`options.kv_remote_password_file`, else $KVSERVE_KV_REMOTE_PASSWORD)."""
    # Keys first: a bad key file fails in a second, not after the model has loaded.
    secret = (
        load_or_create_secret(config.cache_dir)
        if options.tenant_secret_file is None
        else read_secret(options.tenant_secret_file)
    )
    kv_remote = options.kv_remote
    if kv_remote is not None:
        kv_remote = url_with_password(kv_remote, read_kv_remote_password(options.kv_remote_password_file))
    tenants = Tenants(secret, options.api_key, options.api_key_file, options.admin_key)
    log.info("tenancy: %s", tenants.describe())
    tenants.install_sighup_reload()
    engine = Engine.from_config(dataclasses.replace(config, secret=secret, kv_remote=kv_remote))
    async_engine = AsyncEngine(engine)
    app = create_app(async_engine, options, tenants)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=options.host,
            port=options.port,
            # kvserve's logging setup applies, and the server writes its own line per request.
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=options.shutdown_grace_s,
        )
    )

    def stop_on_engine_failure(error: BaseException) -> None:
        # Runs on the engine thread; uvicorn polls should_exit, then lets the failed responses go out.
        server.should_exit = True

    async_engine.on_failure = stop_on_engine_failure
    # Started: the library code and constants that only loading and startup ran leave the resident set
    # (about 70 MiB, mostly torch's operator registrations); what serving runs comes back on first use.
    release_startup_pages()
    # What startup made lives as long as the process (the model's and the tokenizer's objects, the
    # libraries' modules: about 200,000 objects); frozen out of the collector's reach, a full collection no
    # longer walks them on every step's garbage (136 ms each with a 262,144-token vocabulary loaded,
    # streams stalling behind it).
    gc.freeze()
    with suppress(KeyboardInterrupt):
        server.run()
    if async_engine.failure is not None:
        log.error("exiting because the engine failed: %s", async_engine.failure)
        return 1
    return 0 if server.started else 1
