"""Limits on what one request may ask, checked before any work starts, so that no input can stall or
break the server: body size, prompt length before rendering, sequences (prompts x n) per request and
room for them in the engine's queue, and requests in flight per tenant.

Every refusal is an OpenAI-shaped 4xx and happens before the engine sees the request: nothing is
half-done.
"""

from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.engine.async_engine import fair_share, has_room
from kvserve.errors import EngineOverloadedError, InvalidRequestError
from kvserve.server.errors import RETRY_AFTER_S, APIError

# Field limits of the protocol; each is far above what a real client sends.
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 256
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
MAX_CACHE_SALT_CHARS = 256
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
        await error.response()(scope, receive, send)


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


@dataclass(frozen=True)
class PromptGuard:
    """Refuses a prompt text that must be over the context before it is rendered or tokenized.

    No token is longer than `max_token_chars` characters, so a text of more than
    max_model_len * max_token_chars characters has more than max_model_len tokens, whatever they are.
    """

    max_model_len: int
    max_token_chars: int

    def check(self, texts: Sequence[str], param: str) -> None:
        chars = sum(len(t) for t in texts)
        if chars > self.max_model_len * self.max_token_chars:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens, and {chars} "
                f"characters are more tokens than that; shorten the {param}.",
                param,
            )
        for text in texts:
            if not text.isascii():
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    raise InvalidRequestError(
                        "The text is not valid Unicode (it has a lone surrogate escape).", param
                    ) from None


def check_sequences(num_prompts: int, n: int, limit: int) -> None:
    """Refuses a request of more than `limit` sequences (prompts x n) before any of them is built: the
    work and memory of a request grow with its sequences, and its body alone does not bound them."""
    if num_prompts * n > limit:
        raise APIError(
            400,
            f"This request asks for {num_prompts} prompt(s) x n={n} = {num_prompts * n} sequences; this "
            f"server takes at most {limit} per request (--max-sequences-per-request). Send fewer prompts "
            "or a smaller n.",
            param="n" if n > limit else "prompt",
            code="too_many_sequences",
        )


@dataclass
class Reservation:
    """Room held in the engine's queue for one request's sequences until they reach the engine."""

    admission: "SequenceAdmission"
    tenant: str
    count: int

    def release(self) -> None:
        """Hand the room back: the sequences are in the engine (counted there) or will never be; a
        second release does nothing."""
        self.admission.reserved[self.tenant] -= self.count
        if not self.admission.reserved[self.tenant]:
            del self.admission.reserved[self.tenant]
        self.count = 0


@dataclass
class SequenceAdmission:
    """Room in the engine's queue for a whole request, taken before any of its sequences is built.

    `capacity` is what the engine takes in flight (waiting plus running), `in_flight` its sequences per
    tenant now. A request's sequences are reserved here, per tenant, until they have reached the engine,
    so that two requests checked at once cannot both count the same room. Room is shared between tenants
    by the engine's own rule (`has_room`): a tenant within its equal share is admitted even when others
    have filled the rest. Runs on the event loop only.
    """

    capacity: int
    in_flight: Callable[[], Mapping[str, int]]
    reserved: Counter[str] = field(default_factory=Counter)

    @contextmanager
    def reserve(self, tenant: str, count: int) -> Iterator[Reservation]:
        """Hold room for `count` sequences of `tenant` until released or the block ends: a 400 for a
        request larger than the whole queue (it can never run), a 503 with Retry-After when there is no
        room for all of it now."""
        if count > self.capacity:
            raise APIError(
                400,
                f"This request has {count} sequences (prompts x n); the server queues at most "
                f"{self.capacity} at once (--max-waiting). Send fewer prompts or a smaller n.",
                param="n",
                code="too_many_sequences",
            )
        held = Counter(self.in_flight()) + self.reserved
        if not has_room(self.capacity, held, tenant, count):
            raise EngineOverloadedError(
                f"the server is at capacity ({self.capacity} sequences in flight, "
                f"{fair_share(self.capacity, held, tenant)} for this tenant) and has no room for this "
                f"request's {count}; retry later"
            )
        room = Reservation(self, tenant, max(count, 0))
        self.reserved[tenant] += room.count
        try:
            yield room
        finally:
            room.release()
