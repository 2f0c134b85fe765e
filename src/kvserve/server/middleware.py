"""What the server holds back before a request reaches its route: the body's bytes (an ASGI middleware)
and the tenant's slot of requests in flight (a route dependency). Neither needs the engine; everything
that does (sequences, room in the queue, tokens) is the engine door's (AsyncEngine)."""

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.server.errors import RETRY_AFTER_S, APIError, is_anthropic_path

# An oversized body is read and dropped up to this many times the limit, so that a client still
# writing gets its 413 rather than a reset connection; past that the connection is simply closed.
_DRAIN_FACTOR = 8


class BodySizeLimit:
    """ASGI middleware: a request body over `max_bytes` gets a 413 before the app parses any of it.

    The body is read here (the app would read it all anyway) and handed to the app whole; later
    receives (the client's disconnect) pass through.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        too_large = declared.isdigit() and int(declared) > self.max_bytes
        chunks: list[bytes] = []
        size = 0
        more = not too_large
        while more:
            message = await receive()
            if message["type"] != "http.request":
                # The client left before its body was complete: nothing to answer.
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            more = message.get("more_body", False)
            if size > self.max_bytes:
                too_large = True
                break
            chunks.append(chunk)
        if too_large:
            await self._drain(receive, more or declared.isdigit(), size)
            await self._refuse(scope, receive, send)
            return
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _drain(self, receive: Receive, more: bool, size: int) -> None:
        while more and size <= self.max_bytes * _DRAIN_FACTOR:
            message = await receive()
            if message["type"] != "http.request":
                return
            size += len(message.get("body", b""))
            more = message.get("more_body", False)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(
            413,
            f"The request body is larger than this server accepts ({self.max_bytes} bytes, "
            "--max-request-bytes); send a shorter prompt.",
            code="request_too_large",
        )
        await error.response(is_anthropic_path(scope["path"]))(scope, receive, send)


@dataclass
class InFlightLimiter:
    """Requests in flight per tenant: one tenant cannot take every slot of the engine's queue."""

    limit: int
    _counts: Counter[str] = field(default_factory=Counter)

    def in_flight(self, tenant: str) -> int:
        return self._counts[tenant]

    @contextmanager
    def slot(self, tenant: str) -> Iterator[None]:
        """Hold one of the tenant's slots for the whole request (a stream until its last event);
        a 429 with Retry-After when the tenant has none left. Runs on the event loop only."""
        if self._counts[tenant] >= self.limit:
            raise APIError(
                429,
                f"Too many requests in flight for this API key ({self.limit}); retry when one finishes.",
                "rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        self._counts[tenant] += 1
        try:
            yield
        finally:
            self._counts[tenant] -= 1
            if not self._counts[tenant]:
                del self._counts[tenant]
