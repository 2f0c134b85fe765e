"""X-Request-Id: taken from the request (or made), answered as a header, used as the log line's id.

A plain ASGI middleware: it only adds a header to the response start, so streams and disconnect
detection pass through untouched (Starlette's BaseHTTPMiddleware would wrap both).
"""

import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"
# What a client may choose: a log line and a header must stay one clean line.
_VALID = re.compile(r"[\x21-\x7e]{1,128}")


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next(
            (v.decode("latin-1") for k, v in scope["headers"] if k.decode("latin-1").lower() == HEADER), ""
        )
        request_id = given if _VALID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (HEADER.encode(), request_id.encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)
