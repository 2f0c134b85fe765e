"""The FastAPI app, the server's composition root: `create_app` builds the context around an AsyncEngine
and mounts each API's routers (server/openai, server/responses, server/anthropic, server/cache_api) by the
access their routes ask; the server's own routes (health, identity, version, metrics) are here; `serve`
runs it for the CLI."""

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
from fastapi import FastAPI, Query, Response
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import CONTENT_TYPE_LATEST

from kvserve import __version__
from kvserve.config import EngineConfig
from kvserve.credentials import identity_proof, read_kv_remote_password, url_with_password
from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.model.heap import release_startup_pages
from kvserve.options import ServerOptions
from kvserve.secret import read_secret
from kvserve.server.anthropic import routes as anthropic_routes
from kvserve.server.anthropic.errors import ERROR_SHAPE as ANTHROPIC_ERRORS
from kvserve.server.cache_api import routes as cache_routes
from kvserve.server.cache_api.dashboard import Dashboard, StatsHistory
from kvserve.server.core.chat_setup import chat_setup, read_chat_template
from kvserve.server.core.context import Context, ServerContext
from kvserve.server.core.preparation import PreparationPool
from kvserve.server.core.prompts import PromptGuard
from kvserve.server.http.errors import APIError, ErrorShapes, install_error_handlers
from kvserve.server.http.metrics import ServerMetrics
from kvserve.server.http.middleware import InFlightLimiter, RequestGate, route_access
from kvserve.server.http.request_id import RequestIdMiddleware
from kvserve.server.http.routing import Routers
from kvserve.server.http.tenants import Tenants, load_or_create_secret
from kvserve.server.openai import routes as openai_routes
from kvserve.server.responses import routes as responses_routes
from kvserve.server.responses.persist import DiskBackend, RedisBackend
from kvserve.server.responses.store import Backend, ResponseStore, StoreLimits

log = logging.getLogger("kvserve.server")

# /health fails if the engine thread does not answer within this long (a step can take seconds on a CPU).
HEALTH_TIMEOUT_S = 10


# The server's own routes (health, identity, version, metrics); each API brings its own.
ROUTES = Routers()
# Every router, with the access its routes ask (server/http/routing.py), mounted in this order.
ROUTERS = tuple(
    pair
    for routes in (
        ROUTES,
        openai_routes.ROUTES,
        responses_routes.ROUTES,
        anthropic_routes.ROUTES,
        cache_routes.ROUTES,
    )
    for pair in routes.by_access()
)


@ROUTES.public.get("/health")
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
@ROUTES.public.get("/identity", include_in_schema=False)
async def identity(
    ctx: Context, challenge: Annotated[str, Query(pattern=_CHALLENGE_HEX)]
) -> dict[str, object]:
    nonce = ctx.options.launch_nonce
    if nonce is None:
        raise APIError(404, "This server was not started by `kvserve cluster`.", code="not_found")
    pid = os.getpid()
    return {"pid": pid, "proof": identity_proof(nonce, bytes.fromhex(challenge), pid)}


@ROUTES.keyed.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


# Every tenant's rows (names, cached tokens request by request): the operator's view, so the admin key's
# once the server has keys (see check_admin_key).
@ROUTES.admin.get("/metrics")
async def metrics(ctx: Context) -> Response:
    return Response(await ctx.metrics.exposition(ctx.async_engine), media_type=CONTENT_TYPE_LATEST)


@ROUTES.admin.post("/reset_prefix_cache")
async def reset_prefix_cache(ctx: Context) -> dict[str, int]:
    """Drop every cached block no request is using (as vLLM's route does, for benchmark clients)."""
    return {"freed_blocks": await ctx.async_engine.reset_prefix_cache()}


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
        # Listening from here: the engine's startup probe (if pending) runs while /health answers.
        async_engine.start_probe()
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
    shapes = ErrorShapes((ANTHROPIC_ERRORS,))
    install_error_handlers(app, shapes)
    for router, _ in ROUTERS:
        app.include_router(router)
    # Inside CORS, so that its refusals carry CORS headers and preflights never reach it.
    app.add_middleware(
        RequestGate,
        access=route_access(ROUTERS),
        tenants=tenants,
        in_flight=app.state.context.in_flight,
        max_bytes=options.max_request_bytes,
        shapes=shapes,
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
    # The probe runs once the server listens (AsyncEngine.start_probe), not before /health answers.
    engine = Engine.from_config(
        dataclasses.replace(config, secret=secret, kv_remote=kv_remote), probe_now=False
    )
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
    # Started: the library code and constants that only loading and startup ran (mostly torch's operator
    # registrations) leave the resident set; what serving runs comes back on first use.
    release_startup_pages()
    # What startup made lives as long as the process (the model's and the tokenizer's objects, the
    # libraries' modules); frozen out of the collector's reach, a full collection no longer walks them on
    # every step's garbage, with streams stalling behind it (docs/benchmarks.md has the cost).
    gc.freeze()
    with suppress(KeyboardInterrupt):
        server.run()
    if async_engine.failure is not None:
        log.error("exiting because the engine failed: %s", async_engine.failure)
        return 1
    return 0 if server.started else 1
