"""The Responses API's routes: create, get, delete, and a stored response's input items."""

from typing import Annotated

from fastapi import Depends, Query, Request, Response

from kvserve.server.core.context import Context, check_model
from kvserve.server.http.auth import cache_namespace, caller
from kvserve.server.http.routing import Routers
from kvserve.server.responses.protocol import InputItemList, ResponseDeleted, ResponsesRequest
from kvserve.server.responses.serving import item_list, respond_responses, unknown_response
from kvserve.server.responses.serving import prepare as prepare_response
from kvserve.server.responses.store import ResponseStore

ROUTES = Routers()


def _response_store(request: Request) -> ResponseStore:
    """The stored responses: the Responses API's own state, which create_app keeps in app.state."""
    store: ResponseStore = request.app.state.responses
    return store


Stored = Annotated[ResponseStore, Depends(_response_store)]


# The Responses API: its own converter (server/responses/convert.py) over chat's prompt, tools and
# constraints, and its own writer (server/responses/serving.py); its stored responses are the tenant's alone.
@ROUTES.api.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request, ctx: Context, store: Stored) -> Response:
    check_model(ctx, body.model)
    namespace = cache_namespace(request)
    tenant = caller(request).tenant.name
    with ctx.async_engine.reserve(tenant, 1, 1) as room:
        prepared = await ctx.preparation.run(tenant, prepare_response, ctx, store, body, namespace, tenant)
        return await respond_responses(ctx, store, request, body, prepared, room, tenant)


@ROUTES.api.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request, ctx: Context, store: Stored) -> Response:
    tenant = caller(request).tenant.name
    stored = await ctx.preparation.run(tenant, store.get, tenant, response_id)
    if stored is None:
        raise unknown_response(response_id)
    # The very bytes the POST answered: nothing is parsed or written on the event loop.
    return Response(stored.response, media_type="application/json")


@ROUTES.api.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request, ctx: Context, store: Stored) -> ResponseDeleted:
    tenant = caller(request).tenant.name
    if not await ctx.preparation.run(tenant, store.delete, tenant, response_id):
        raise unknown_response(response_id)
    return ResponseDeleted(id=response_id)


@ROUTES.api.get("/v1/responses/{response_id}/input_items", response_model=InputItemList)
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
