"""What the server checks before a request reaches its route, in the ASGI layer and before the app reads
a byte of the body: who is calling (the key, server/http/auth.py), the tenant's slot of requests in flight,
then the body's size. A keyless or over-quota request is answered from its headers alone, so a flood of
them costs the event loop a header lookup each, whatever bodies they carry. Nothing here needs the
engine; everything that does (sequences, room in the queue, tokens) is the engine door's (AsyncEngine).
"""

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from fastapi import APIRouter
from starlette.datastructures import Headers
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.server.http.auth import authenticate, check_admin_key
from kvserve.server.http.errors import RETRY_AFTER_S, APIError, ErrorShapes
from kvserve.server.http.tenants import Tenants

log = logging.getLogger("kvserve.server")

# An oversized body is read and dropped up to this many times the limit, so that a client still
# writing gets its 413 rather than a reset connection; past that the connection is simply closed.
_DRAIN_FACTOR = 8


class Access(Enum):
    """What a route asks of its caller before the app sees the request."""

    # Nothing: /health, /identity, the dashboard's static shell.
    OPEN = "open"
    # The admin key (or a server without keys): every tenant's rows.
    ADMIN = "admin"
    # A key; the route answers the server's constants (/version, /v1/models), so it takes no slot.
    KEY = "key"
    # A key, and one of its tenant's in-flight slots for the request's whole life (a stream to its last
    # event): every route that reads or writes the tenant's state.
    TENANT = "tenant"


def route_access(routers: Sequence[tuple[APIRouter, Access]]) -> Callable[[Scope], Access | None]:
    """The access of the route a request reaches, among the routes of `routers` (included in the app
    as they are, without a prefix), each router's access for all of its routes; None for no route."""
    table = [(route, access) for router, access in routers for route in router.routes]

    def access(scope: Scope) -> Access | None:
        for route, asked in table:
            if route.matches(scope)[0] is Match.FULL:
                return asked
        return None

    return access


@dataclass
class InFlightLimiter:
    """Requests in flight per tenant: one tenant cannot take every slot of the engine's queue. Used on
    the event loop only."""

    limit: int
    _counts: Counter[str] = field(default_factory=Counter)

    def in_flight(self, tenant: str) -> int:
        return self._counts[tenant]

    def take(self, tenant: str) -> None:
        """One of the tenant's slots, or a 429 with Retry-After when it has none left."""
        if self._counts[tenant] >= self.limit:
            raise APIError(
                429,
                f"Too many requests in flight for this API key ({self.limit}); retry when one finishes.",
                "rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self._counts[tenant] += 1

    def give_back(self, tenant: str) -> None:
        self._counts[tenant] -= 1
        if not self._counts[tenant]:
            del self._counts[tenant]


class _TooLarge(Exception):
    """The body is over the limit (declared or read); `more` when the client is still sending it."""

    def __init__(self, more: bool) -> None:
        self.more = more


class _Gone(Exception):
    """The client left before its body was complete: nothing to answer."""


class RequestGate:
    """ASGI middleware: the key, the tenant's slot and the body's size, in that order, before the app.

    `access(scope)` is the access of the route the request will reach, None when it reaches none (the
    app answers 404 or 405 without reading the body). The caller goes to `scope["state"]["caller"]`
    (`request.state.caller` in a route, server/http/auth.py:caller); the slot is held until the app sends
    its answer's last bytes, a stream's included, and given back however it ends. The body is then read
    here, up to `max_bytes` (413 above it, declared or chunked), and handed to the app whole; later
    receives (the client's disconnect) pass through.
    """

    def __init__(
        self,
        app: ASGIApp,
        access: Callable[[Scope], Access | None],
        tenants: Tenants,
        in_flight: InFlightLimiter,
        max_bytes: int,
        shapes: ErrorShapes | None = None,
    ) -> None:
        self.app = app
        self.access = access
        self.tenants = tenants
        self.in_flight = in_flight
        self.max_bytes = max_bytes
        # OpenAI's shape on every path unless told otherwise.
        self.shapes = shapes or ErrorShapes()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        access = self.access(scope)
        if access is None:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        tenant: str | None = None
        try:
            if access is Access.ADMIN:
                check_admin_key(headers, self.tenants)
            elif access is not Access.OPEN:
                caller = authenticate(headers, self.tenants)
                scope.setdefault("state", {})["caller"] = caller
                if access is Access.TENANT:
                    self.in_flight.take(caller.tenant.name)
                    tenant = caller.tenant.name
        except APIError as error:
            await _refuse(error, self.shapes, scope, receive, send)
            return
        held = tenant is not None

        def give_back() -> None:
            nonlocal held
            if held and tenant is not None:
                held = False
                self.in_flight.give_back(tenant)

        async def sending(message: Message) -> None:
            # The slot is free before the answer's last bytes go out: a client that sends its next
            # request once it has this answer never finds its slot still taken.
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                give_back()
            await send(message)

        try:
            await self._with_body(scope, receive, sending, headers)
        finally:
            give_back()

    async def _with_body(self, scope: Scope, receive: Receive, send: Send, headers: Headers) -> None:
        declared = headers.get("content-length", "")
        try:
            if declared.isdigit() and int(declared) > self.max_bytes:
                raise _TooLarge(more=True)
            body = await self._read(receive)
        except _Gone:
            return
        except _TooLarge as e:
            if e.more:
                await self._drain(receive)
            error = APIError(
                413,
                f"The request body is larger than this server accepts ({self.max_bytes} bytes, "
                "--max-request-bytes); send a shorter prompt.",
                code="request_too_large",
            )
            await _refuse(error, self.shapes, scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                raise _Gone
            chunk = message.get("body", b"")
            size += len(chunk)
            more = message.get("more_body", False)
            if size > self.max_bytes:
                raise _TooLarge(more)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _drain(self, receive: Receive) -> None:
        # Whatever part of the body is still coming, up to the drain's own bound; the server's
        # protocol drops the rest once the answer is sent.
        size = 0
        while size <= self.max_bytes * _DRAIN_FACTOR:
            message = await receive()
            if message["type"] != "http.request":
                return
            size += len(message.get("body", b""))
            if not message.get("more_body", False):
                return


async def _refuse(error: APIError, shapes: ErrorShapes, scope: Scope, receive: Receive, send: Send) -> None:
    path: str = scope["path"]
    log.info("%s %s -> %d: %s", scope["method"], path, error.status, error.detail.message)
    await error.response(shapes.for_path(path))(scope, receive, send)
