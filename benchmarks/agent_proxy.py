"""A recording reverse proxy between the agents' CLIs and kvserve, for `make agents`.

Every request a CLI makes passes through it unchanged (streams included) and is written down: method,
target, headers with the credentials blanked, the body, the status and kvserve's X-Request-Id (which
names the request's line in kvserve's log, where its prompt and cached tokens are). The CLIs also get
it as their HTTP(S) proxy, so that a connection they try to open anywhere but kvserve is refused and
recorded rather than sent: the harness runs offline and shows what would have gone out.
"""

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from starlette.types import Message, Receive, Scope, Send

# Headers that carry a credential: recorded as REDACTED, never as their value.
SECRET_HEADERS = frozenset({"authorization", "x-api-key", "proxy-authorization", "cookie"})
REDACTED = "<redacted>"
# Connection-level headers, which each hop sets for itself.
_HOP_HEADERS = frozenset(
    {"host", "connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "upgrade"}
)
# How much of a refused request's answer is kept (its error message).
_ERROR_BODY_BYTES = 4096


@dataclass
class Exchange:
    """One request as a CLI sent it, and kvserve's answer. `label` names the CLI run that sent it."""

    label: str
    method: str
    target: str
    headers: dict[str, str]
    body: Any
    status: int = 0
    request_id: str | None = None
    error_body: str = ""
    # Set when the request was for anywhere but kvserve (a CONNECT, an absolute URL to another host).
    external: bool = False

    @property
    def path(self) -> str:
        return self.target.partition("?")[0]


def redacted_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for key, value in raw:
        name = key.decode("latin-1").lower()
        text = REDACTED if name in SECRET_HEADERS else value.decode("latin-1")
        headers[name] = f"{headers[name]}, {text}" if name in headers else text
    return headers


def parsed_body(body: bytes) -> Any:
    """The body as JSON when it is JSON, else as text (None when empty)."""
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return body.decode("utf-8", errors="replace")


@dataclass
class RecordingProxy:
    """The ASGI app: forwards to `upstream` (kvserve's URL) and appends an Exchange per request."""

    upstream: str
    own_hosts: frozenset[str]
    label: str = ""
    exchanges: list[Exchange] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        target = scope["raw_path"].decode("latin-1")
        if scope["query_string"]:
            target += "?" + scope["query_string"].decode("latin-1")
        exchange = Exchange(
            self.label, scope["method"], target, redacted_headers(scope["headers"]), parsed_body(body)
        )
        self.exchanges.append(exchange)
        local = self._local_target(target)
        if scope["method"] == "CONNECT" or local is None:
            exchange.external, exchange.status = True, 403
            await _answer(send, 403, b"the agents' harness sends nothing but to kvserve\n")
            return
        await self._forward(exchange, scope, local, body, send)

    def _local_target(self, target: str) -> str | None:
        """The path and query to send to kvserve, or None for a request meant for another host (a
        proxy's absolute-form target)."""
        if target.startswith("/"):
            return target
        url = httpx.URL(target)
        if url.host in self.own_hosts:
            return url.raw_path.decode("latin-1")
        return None

    async def _forward(self, exchange: Exchange, scope: Scope, target: str, body: bytes, send: Send) -> None:
        headers = [(k, v) for k, v in scope["headers"] if k.decode("latin-1").lower() not in _HOP_HEADERS]
        async with httpx.AsyncClient(timeout=None) as client:
            request = client.build_request(
                scope["method"], self.upstream + target, headers=headers, content=body
            )
            try:
                response = await client.send(request, stream=True)
            except httpx.TransportError as e:
                # kvserve is gone: the CLI sees a 502 and the report the reason.
                exchange.status, exchange.error_body = 502, f"{type(e).__name__}: {e}"
                await _answer(send, 502, exchange.error_body.encode())
                return
            try:
                exchange.status = response.status_code
                exchange.request_id = response.headers.get("x-request-id")
                out = [
                    (k, v) for k, v in response.headers.raw if k.decode("latin-1").lower() not in _HOP_HEADERS
                ]
                await send({"type": "http.response.start", "status": response.status_code, "headers": out})
                kept = b""
                async for chunk in response.aiter_raw():
                    if not 200 <= response.status_code < 300 and len(kept) < _ERROR_BODY_BYTES:
                        kept += chunk[: _ERROR_BODY_BYTES - len(kept)]
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                exchange.error_body = kept.decode("utf-8", errors="replace")
            finally:
                await response.aclose()

    @staticmethod
    async def _lifespan(receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _answer(send: Send, status: int, text: bytes) -> None:
    start: Message = {
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"text/plain")],
    }
    await send(start)
    await send({"type": "http.response.body", "body": text})


@contextmanager
def running_proxy(upstream: str) -> Iterator[tuple[RecordingProxy, str]]:
    """The proxy on a free loopback port, in a thread of its own: yields (proxy, its URL)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    proxy = RecordingProxy(upstream, frozenset({"127.0.0.1", "localhost"}))
    server = uvicorn.Server(uvicorn.Config(proxy, log_config=None, access_log=False, lifespan="on"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the recording proxy did not start")
        time.sleep(0.02)
    try:
        yield proxy, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
