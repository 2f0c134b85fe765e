"""Finding 1 of the fourth hardening review: bodies were parsed before anything was checked, at about 25x
their size (an 8 MiB body of ignored `{}` held 210 MB while its request lived, with or without a key),
and count_tokens and the stored-response reads took no in-flight slot.

Now the key, the tenant's in-flight slot and the body's size are checked in the ASGI layer before a byte
of the body is read (server/http/middleware.py), every route of a tenant's state takes a slot, and bodies are
counted and then validated from their bytes (server/http/json_body.py). Memory is the server's resident peak
(VmHWM, reset before each request): the server runs in this process, and the bodies are built before.
"""

import asyncio
import ctypes
import gc
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, closing
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import anthropic
import httpx
import openai
import pytest
from fastapi import FastAPI
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from starlette.types import Message, Receive, Scope, Send

from kvserve.engine.async_engine import AsyncEngine
from kvserve.engine.engine import Engine
from kvserve.options import ServerOptions
from kvserve.server.anthropic.convert import messages_tokens
from kvserve.server.app import create_app
from kvserve.server.http.json_body import JSONBounds
from kvserve.server.http.middleware import Access, InFlightLimiter, RequestGate
from kvserve.server.http.tenants import DEFAULT_TENANT, Tenants

T = TypeVar("T")
HI: anthropic.types.MessageParam = {"role": "user", "content": "Hi"}
KEY = "key-alice-aaaa"
NAME = "m"
MiB = 2**20
BODY_LIMIT = 8 * MiB
BOUNDS = JSONBounds()
# What one request may add to the server's resident set (docs/design.md, *Limits on one request*): its
# body, held whole, a few times over (the chunks read and the joined copy, the masked copy of a count),
# and pydantic-core's parse tree and the objects of the fields a route reads, for every value allowed.
MAX_GROWTH_PER_BODY_BYTE = 4
MAX_GROWTH_PER_VALUE = 160
MAX_GROWTH_FIXED = 16 * MiB
CHAT = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1'
COUNT = b'{"messages": [{"role": "user", "content": "Hi"}]'


def growth_bound(body: bytes, values: int) -> int:
    return MAX_GROWTH_PER_BODY_BYTE * len(body) + MAX_GROWTH_PER_VALUE * values + MAX_GROWTH_FIXED


@dataclass
class Gated:
    url: str
    in_flight: InFlightLimiter


@pytest.fixture(scope="module")
def server(
    make_engine: Callable[..., Engine], serve_app: Callable[[FastAPI], AbstractContextManager[str]]
) -> Iterator[Gated]:
    async_engine = AsyncEngine(make_engine(kv_cache_memory=32 * MiB, max_model_len=512))
    options = ServerOptions(api_key=KEY, max_in_flight_per_tenant=1, served_model_name=NAME)
    app = create_app(async_engine, options)
    with serve_app(app) as url:
        yield Gated(url, app.state.context.in_flight)


def junk(element: bytes, count: int) -> bytes:
    return b"[" + b",".join([element] * count) + b"]"


def with_field(start: bytes, name: str, value: bytes) -> bytes:
    return start + f', "{name}": '.encode() + value + b"}"


# --- Answered from the headers: a raw socket sends part of a body and waits for the answer ---


class PartialPost:
    """A POST whose headers declare a body of `declared` bytes, of which only `sent` are written: the
    client is still sending when the server answers, if it answers from the headers."""

    def __init__(self, url: str, path: str, headers: dict[str, str], declared: int, sent: bytes) -> None:
        parts = urlsplit(url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=60)
        lines = [f"POST {path} HTTP/1.1", f"Host: {parts.netloc}", "Content-Type: application/json"]
        lines += [f"Content-Length: {declared}", *(f"{k}: {v}" for k, v in headers.items())]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + sent)

    def response(self) -> tuple[int, dict[str, str], Any]:
        """The answer's status, headers and JSON body (a timeout fails the test: no answer came)."""
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = self.sock.recv(65536)
            assert chunk, "the server closed the connection without an answer"
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in header_lines)}
        length = int(headers["content-length"])
        while len(rest) < length:
            chunk = self.sock.recv(65536)
            assert chunk
            rest += chunk
        return int(status_line.split()[1]), headers, json.loads(rest[:length])

    def close(self) -> None:
        self.sock.close()


def wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.parametrize(
    "path, anthropic_shape",
    [("/v1/chat/completions", False), ("/v1/responses", False), ("/v1/messages", True)],
)
def test_a_keyless_request_is_answered_before_its_body_is_sent(
    server: Gated, path: str, anthropic_shape: bool
) -> None:
    """The review's probe: without a key, each 8 MiB body held the event loop 0.3 s before its 401.
    The 401 now comes from the headers, while the client has sent 64 KiB of the 8 MiB it declared."""
    post = PartialPost(server.url, path, {}, BODY_LIMIT - 1, b'{"junk": [' + b"{}," * 20_000)
    with closing(post.sock):
        status, _, body = post.response()
    assert status == 401
    if anthropic_shape:
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    else:
        assert body["error"]["code"] == "invalid_api_key"


def test_a_request_over_its_tenants_slots_is_answered_before_its_body_is_sent(server: Gated) -> None:
    """A request holds its tenant's slot from its headers on, its body's upload included: with one slot,
    a second request is a 429 while the first is still sending; once the first is gone, the slot is back.
    """
    key = {"Authorization": f"Bearer {KEY}"}
    first = PartialPost(server.url, "/v1/chat/completions", key, 1000, CHAT[:10])
    try:
        wait_for(lambda: server.in_flight.in_flight(DEFAULT_TENANT) == 1)
        for path, anthropic_shape in [("/v1/chat/completions", False), ("/v1/messages/count_tokens", True)]:
            second = PartialPost(server.url, path, {"x-api-key": KEY}, 1000, CHAT[:10])
            with closing(second.sock):
                status, headers, body = second.response()
            assert status == 429 and headers["retry-after"] == "1"
            if anthropic_shape:
                assert body["error"]["type"] == "rate_limit_error"
            else:
                assert body["error"]["code"] == "rate_limit_exceeded"
    finally:
        first.close()
    # The client left before its body was complete: its slot is given back.
    wait_for(lambda: server.in_flight.in_flight(DEFAULT_TENANT) == 0)


def test_the_slot_is_free_before_the_answers_last_bytes_go_out() -> None:
    """The gate around an app that answers, streamed or whole, then goes on (as Starlette does after a
    response, tearing down its task group): the slot is back when the last bytes are handed to the
    server, so a client that has the answer never finds its slot taken (given back only once the app
    returned, the full suite once read it still taken after every answer had arrived)."""
    limiter = InFlightLimiter(1)
    after_last_bytes: list[int] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for more in (True, True, False):
            await send({"type": "http.response.body", "body": b"x", "more_body": more})
        await asyncio.sleep(0)

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body" and not message["more_body"]:
            after_last_bytes.append(limiter.in_flight(DEFAULT_TENANT))

    async def receive() -> Message:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    tenants = Tenants(bytes(32))
    gate = RequestGate(app, lambda scope: Access.TENANT, tenants, limiter, max_bytes=2**20)
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    for _ in range(2):
        asyncio.run(gate(scope, receive, send))
    assert after_last_bytes == [0, 0] and limiter.in_flight(DEFAULT_TENANT) == 0


def test_count_tokens_and_stored_response_reads_take_a_slot(
    server: Gated, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The review's probe: with --max-in-flight-per-tenant 1, six concurrent count_tokens all got 200.
    Now one count_tokens in flight (held in its preparation) leaves the tenant no slot: count_tokens and
    every route of its stored responses get a 429 through the real clients, and the constant routes
    (/v1/models) still answer."""
    release = threading.Event()

    def held(*args: Any) -> list[int]:
        assert release.wait(60)
        return messages_tokens(*args)

    monkeypatch.setattr("kvserve.server.anthropic.routes.messages_tokens", held)
    claude = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
    gpt = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
    counted: list[int] = []

    def count() -> None:
        counted.append(claude.messages.count_tokens(model=NAME, messages=[HI]).input_tokens)

    thread = threading.Thread(target=count)
    thread.start()
    try:
        wait_for(lambda: server.in_flight.in_flight(DEFAULT_TENANT) == 1)
        with pytest.raises(anthropic.RateLimitError):
            claude.messages.count_tokens(model=NAME, messages=[HI])
        with pytest.raises(openai.RateLimitError):
            gpt.responses.retrieve("resp_unknown")
        with pytest.raises(openai.RateLimitError):
            gpt.responses.delete("resp_unknown")
        with pytest.raises(openai.RateLimitError):
            gpt.responses.input_items.list("resp_unknown")
        assert [m.id for m in gpt.models.list().data] == [NAME]
    finally:
        release.set()
        thread.join(timeout=120)
    assert counted and counted[0] > 0
    wait_for(lambda: server.in_flight.in_flight(DEFAULT_TENANT) == 0)
    with pytest.raises(openai.NotFoundError):
        gpt.responses.retrieve("resp_unknown")


def test_a_keyless_flood_reads_no_body(server: Gated, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keyless clients sending 8 MiB bodies without pause: the gate reads none of them (counted), and
    /health answers between them; the same bodies with the key are each read once."""
    reads: list[int] = []
    read = RequestGate._read

    async def counted(self: RequestGate, receive: Any) -> bytes:
        body = await read(self, receive)
        reads.append(len(body))
        return body

    monkeypatch.setattr(RequestGate, "_read", counted)
    body = with_field(CHAT, "junk", junk(b"{}", (BODY_LIMIT - 200) // 3))
    statuses: list[int] = []
    health: list[int] = []
    stop = threading.Event()

    def flood() -> None:
        with httpx.Client(timeout=120) as client:
            while not stop.is_set():
                statuses.append(client.post(f"{server.url}/v1/chat/completions", content=body).status_code)

    threads = [threading.Thread(target=flood) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(statuses) >= 4)
        for _ in range(10):
            health.append(httpx.get(f"{server.url}/health", timeout=120).status_code)
        wait_for(lambda: len(statuses) >= 8)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert set(statuses) == {401} and health == [200] * 10
    health_reads = len(reads)
    # /health's own (empty) bodies are the only ones read.
    assert all(size == 0 for size in reads)
    keyed = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    refused = httpx.post(f"{server.url}/v1/chat/completions", content=body, headers=keyed, timeout=120)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "request_too_complex"
    assert reads[health_reads:] == [len(body)]


# --- Memory: the server's resident peak around one request ---

_LIBC = ctypes.CDLL("libc.so.6")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def peak_growth(send: Callable[[], T], tries: int = 3) -> tuple[int, T]:
    """How far the process's resident set rose above where it stood while `send` ran: freed memory is
    first given back to the system, so that the request's own is counted again. The least of `tries`
    sends: other threads of this process (a full run's) only ever add to a measure."""
    growths = []
    for _ in range(tries):
        gc.collect()
        _LIBC.malloc_trim(0)
        start = _status("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        response = send()
        growths.append(_status("VmHWM") - start)
    return min(growths), response


# One client for every measured request: a new one loads its CA certificates (megabytes) each time.
_CLIENT = httpx.Client(timeout=300)


def post(server: Gated, path: str, body: bytes, key: bool = True) -> Callable[[], httpx.Response]:
    headers = {"content-type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {KEY}"
    return lambda: _CLIENT.post(f"{server.url}{path}", content=body, headers=headers)


def test_an_8_mib_body_of_ignored_objects_costs_about_its_bytes(server: Gated) -> None:
    """The review's probe: 8 MiB of `"junk": [{}, {}, ...]` held about 210 MB while its request lived,
    with or without a key. Without a key it is now never read; with one it is counted and refused
    before pydantic parses it; under the bounds an ignored field is never made into Python objects."""
    body = with_field(CHAT, "junk", junk(b"{}", (BODY_LIMIT - 200) // 3))
    # Warm: the first request through the client sets up what every later one reuses.
    post(server, "/v1/chat/completions", body, key=False)()
    keyless, r = peak_growth(post(server, "/v1/chat/completions", body, key=False))
    assert r.status_code == 401
    # The client in this process copies the body as it sends it: less than that is the server's share.
    assert keyless < len(body), keyless
    keyed, r = peak_growth(post(server, "/v1/chat/completions", body))
    assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_complex", r.text
    assert keyed < growth_bound(body, 0), keyed
    # As many ignored objects as the bounds allow, through the real client: answered, for little more
    # than pydantic-core's tree of them.
    gpt = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)
    objects = BOUNDS.max_containers - 10
    under, completion = peak_growth(
        lambda: gpt.chat.completions.with_raw_response.create(
            model=NAME,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=1,
            extra_body={"junk": [{}] * objects},
        )
    )
    assert completion.status_code == 200
    assert under < growth_bound(b"{}," * objects, objects), under


ROUTES = [("/v1/chat/completions", CHAT), ("/v1/messages/count_tokens", COUNT)]


def _strings(count: int) -> bytes:
    # Distinct, so that pydantic's cache of short strings does not share them.
    return b"[" + b",".join(b'"%x"' % i for i in range(count)) + b"]"


def _materialized(value: bytes) -> bytes:
    return with_field(CHAT, "chat_template_kwargs", b'{"x": ' + value + b"}")


# The most a route materializes: as many values as the bounds allow, each its own Python object.
WORST = [
    ("/v1/chat/completions", _materialized(_strings(BOUNDS.max_values - 10))),
    ("/v1/chat/completions", _materialized(junk(b"123456", BOUNDS.max_values - 10))),
    ("/v1/chat/completions", _materialized(junk(b"{}", BOUNDS.max_containers - 10))),
    ("/v1/messages/count_tokens", with_field(COUNT, "junk", _strings(BOUNDS.max_values - 10))),
]


@st.composite
def accepted_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """A request body within the bounds: a chat, or a token count, carrying an ignored field or a field
    the route materializes (chat_template_kwargs: any JSON) of one kind of value, as many as the bounds
    allow, or nested up to pydantic-core's depth."""
    kind = draw(st.sampled_from(["{}", "[]", "0", "123456", "string", "1.5", "null", "nested"]))
    limit = BOUNDS.max_containers if kind in ("{}", "[]") else BOUNDS.max_values
    count = draw(st.one_of(st.integers(0, 1000), st.integers(0, limit - 10)))
    if kind == "string":
        value = _strings(count)
    elif kind == "nested":
        depth = draw(st.integers(1, 150))
        value = b"[" * depth + b"1" + b"]" * depth
    else:
        value = junk(kind.encode(), count)
    route, start = draw(st.sampled_from(ROUTES))
    field = draw(st.sampled_from(["junk", "chat_template_kwargs"])) if start is CHAT else "junk"
    if field == "chat_template_kwargs":
        value = b'{"x": ' + value + b"}"
    return route, with_field(start, field, value)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(case=accepted_bodies())
@example(case=WORST[0])
@example(case=WORST[1])
@example(case=WORST[2])
@example(case=WORST[3])
def test_memory_per_request_is_bounded_over_accepted_bodies(server: Gated, case: tuple[str, bytes]) -> None:
    route, body = case
    # No string of these bodies holds a comma or a bracket, so the raw counts are the values'.
    values = body.count(b",") + body.count(b"[") + body.count(b"{") + 1
    assert len(body) <= BODY_LIMIT and values <= BOUNDS.max_values
    growth, r = peak_growth(post(server, route, body))
    assert r.status_code < 500, r.text
    assert growth < growth_bound(body, values), (growth, len(body), values, r.status_code)
