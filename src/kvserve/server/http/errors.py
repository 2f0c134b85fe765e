"""Errors: every failure answers its status and a body in its API's shape, never a stack trace: OpenAI's
`{"error": {message, type, param, code}}` unless the route's API has its own (`ErrorShapes`: Anthropic's,
server/anthropic/errors.py).

One mapping (`to_api_error`) turns any exception into its status and detail, so that a handler before the
response and an error event inside a stream say the same thing. A request refused as sent is an
InvalidRequestError, the one 400 type (`bad_request`); APIError carries any other status.
"""

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from kvserve.engine.async_engine import EngineDeadError, EngineFailedError
from kvserve.errors import EngineOverloadedError, InvalidRequestError

log = logging.getLogger("kvserve.server")

# Seconds a client should wait before retrying a request refused for lack of capacity.
RETRY_AFTER_S = 1
# nginx's code for "client closed request": the client is gone, so nobody reads it, but logs show why.
CLIENT_CLOSED_REQUEST = 499
# An error's message and param may quote what the client sent (a field's name, a part's type); they are
# cut to this many characters, so that a megabyte name is not echoed back and logged whole.
MAX_ECHO_CHARS = 1000


def _cut(text: str) -> str:
    return text if len(text) <= MAX_ECHO_CHARS else text[:MAX_ECHO_CHARS] + "..."


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class APIError(Exception):
    """An error the server answers on purpose, with its HTTP status: what the mapping renders, and what
    a route raises for any status but 400. A request refused as sent is an InvalidRequestError (the one
    400 type, which the engine raises too), rendered by `bad_request`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(_cut(message))
        self.status = status
        self.detail = ErrorDetail(
            message=_cut(message), type=type, param=None if param is None else _cut(param), code=code
        )
        self.headers = dict(headers or {})

    def response(self, shape: "ErrorShape | None" = None) -> Response:
        """The error as a response, its body in `shape` (OpenAI's by default)."""
        shaped = (shape or openai_error)(self)
        # ASCII-escaped: a message may quote client text holding a lone surrogate, which UTF-8 cannot encode.
        body = json.dumps(shaped, ensure_ascii=True)
        return Response(body, status_code=self.status, headers=self.headers, media_type="application/json")


# How an API shapes an error's body.
ErrorShape = Callable[[APIError], dict[str, Any]]


def openai_error(error: APIError) -> dict[str, Any]:
    """`{"error": {message, type, param, code}}`: every route's shape unless its API has its own."""
    return ErrorResponse(error=error.detail).model_dump()


@dataclass(frozen=True)
class ErrorShapes:
    """The error shape of each API whose routes share a path prefix (Anthropic's, `/v1/messages...`);
    OpenAI's on every other path. app.py gives the gate and the handlers the same one."""

    by_prefix: tuple[tuple[str, ErrorShape], ...] = ()

    def for_path(self, path: str) -> ErrorShape:
        for prefix, shape in self.by_prefix:
            if path == prefix or path.startswith(prefix + "/"):
                return shape
        return openai_error


class BodyError(HTTPException):
    """A body refused while FastAPI reads it (server/http/json_body.py): FastAPI passes an HTTPException
    raised there on as it is, where any other exception would become its own generic 400."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.status, error.detail.message)
        self.error = error


class ClientDisconnected(Exception):
    """The client hung up before its response was ready; its engine request has been aborted."""


# Pydantic names the member of a union that failed ("str", "list[int]", "constrained-str") in the error
# location; a user thinks in field paths, so those labels are dropped.
_UNION_MEMBER_LABELS = {"str", "int", "float", "bool", "none"}


def _is_union_label(part: object) -> bool:
    return isinstance(part, str) and (
        "[" in part or part in _UNION_MEMBER_LABELS or part.startswith("constrained-")
    )


def _field_path(loc: Sequence[Any]) -> str:
    return ".".join(str(p) for p in loc[1:] if not _is_union_label(p))


def validation_error(errors: Sequence[Any]) -> APIError:
    """FastAPI's 422 list of errors as one readable 400."""
    for error in errors:
        if error.get("type") == "json_invalid":
            reason = error.get("ctx", {}).get("error", "malformed JSON")
            return APIError(400, f"The request body is not valid JSON: {reason}. Send a JSON object.")
    lines: list[str] = []
    params: list[str] = []
    for error in errors:
        path = _field_path(error.get("loc", ()))
        line = f"{path}: {error.get('msg', 'invalid value')}" if path else "request body: send a JSON object"
        if line not in lines:
            lines.append(line)
            params.append(path)
    shown = "; ".join(lines[:4]) + ("; ..." if len(lines) > 4 else "")
    return APIError(400, f"Invalid request: {shown}", param=params[0] if params and params[0] else None)


def bad_request(exc: InvalidRequestError) -> APIError:
    """The one 400: an InvalidRequestError with its param and code."""
    return APIError(400, exc.message, param=exc.param, code=exc.code)


def to_api_error(request: Request, exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestValidationError):
        return validation_error(exc.errors())
    if isinstance(exc, BodyError):
        return exc.error
    if isinstance(exc, HTTPException):
        return APIError(
            exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", headers=exc.headers
        )
    if isinstance(exc, InvalidRequestError):
        return bad_request(exc)
    if isinstance(exc, EngineOverloadedError):
        return APIError(
            503, str(exc), "server_error", code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)}
        )
    if isinstance(exc, EngineFailedError):
        return APIError(500, f"The {exc}; the server restarts.", "server_error", code="engine_failed")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "server_error", code="engine_unavailable")
    return APIError(500, "The server had an internal error; the server log has the details.", "server_error")


def install_error_handlers(app: FastAPI, shapes: ErrorShapes) -> None:
    """Every exception answered as its status and body, in the shape of the API whose route it is."""

    async def _handle(request: Request, exc: Exception) -> Response:
        if isinstance(exc, ClientDisconnected):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        error = to_api_error(request, exc)
        if error.status >= 500 and not isinstance(exc, APIError | EngineOverloadedError | EngineDeadError):
            # Starlette re-raises it after this handler answers, so the server logs the traceback as well.
            log.error("%s %s failed: %r", request.method, request.url.path, exc)
        else:
            log.info("%s %s -> %d: %s", request.method, request.url.path, error.status, error.detail.message)
        return error.response(shapes.for_path(request.url.path))

    for exc_class in (
        APIError,
        ClientDisconnected,
        RequestValidationError,
        HTTPException,
        InvalidRequestError,
        EngineOverloadedError,
        EngineDeadError,
        Exception,
    ):
        app.add_exception_handler(exc_class, _handle)
