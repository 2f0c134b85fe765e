"""The cache's routes: its status, pins, the dashboard's page and data."""

from fastapi import Request, Response

from kvserve.errors import InvalidRequestError
from kvserve.server.cache_api.dashboard import ASSETS, CacheStatsResponse, Dashboard, MissStats, asset
from kvserve.server.cache_api.pins import check_pinning_on, pin_plan, pin_prefix, unpin
from kvserve.server.cache_api.protocol import CacheStatus, PinDeleted, PinInfo, PinRequest
from kvserve.server.cache_api.views import cache_status
from kvserve.server.core.context import Context, check_model
from kvserve.server.http.auth import ADMIN_TENANT, cache_namespace, caller, stats_scope
from kvserve.server.http.errors import APIError
from kvserve.server.http.routing import Routers

ROUTES = Routers()


@ROUTES.api.get("/v1/cache/stats")
async def cache_stats(request: Request, ctx: Context) -> CacheStatsResponse:
    """The prefix cache and the requests now, and the counters' history (the dashboard's data): all
    namespaces for the admin key (or a server without keys), only its own for a tenant's key; and
    whichever the key, the last misses of the caller's own namespace."""
    dashboard: Dashboard = request.app.state.dashboard
    namespace = stats_scope(request)

    def label(namespace: str) -> str:
        return ctx.tenants.label(namespace, [ADMIN_TENANT])

    if namespace is None:
        stats = await dashboard.stats(ctx.async_engine, ctx.model_name, label=label)
    else:
        totals = ctx.metrics.tenant_prefix_cache_totals(caller(request).tenant.name)
        stats = await dashboard.stats(ctx.async_engine, ctx.model_name, namespace, totals, label)
    misses = ctx.misses.misses(cache_namespace(request))
    return stats.model_copy(
        update={"misses": [MissStats.model_validate(m, from_attributes=True) for m in misses]}
    )


# The page and its scripts are a static shell with no data in them: everything shown comes from
# /v1/cache/stats, which needs a key when keys are set (the page asks for one on a 401).
@ROUTES.public.get("/dashboard")
async def dashboard_page() -> Response:
    return Response(asset("dashboard.html"), media_type="text/html")


@ROUTES.public.get("/dashboard/{name}")
async def dashboard_asset(name: str) -> Response:
    if name not in ASSETS:
        raise APIError(404, f"No dashboard file {name!r}.", code="not_found")
    return Response(asset(name), media_type=ASSETS[name])


@ROUTES.api.post("/v1/cache/pin")
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


@ROUTES.api.delete("/v1/cache/pin/{pin_id}")
async def delete_pin(pin_id: str, request: Request, ctx: Context) -> PinDeleted:
    await unpin(ctx, cache_namespace(request), pin_id)
    return PinDeleted(id=pin_id)


@ROUTES.api.get("/v1/cache")
async def cache(request: Request, ctx: Context) -> CacheStatus:
    whole_pool = stats_scope(request) is None
    return cache_status(await ctx.async_engine.cache_view(cache_namespace(request), whole_pool))
