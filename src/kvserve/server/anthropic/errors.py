"""Anthropic's error shape, `{"type": "error", "error": {type, message}}`, on its routes
(`/v1/messages...`): before the response (server/http/errors.py:ErrorShapes) and in a stream's error
event (server/anthropic/serving.py)."""

from typing import Any

from kvserve.server.http.errors import APIError

# Anthropic's error types by status; any other status is an `api_error`.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
ANTHROPIC_PREFIX = "/v1/messages"


def is_anthropic_path(path: str) -> bool:
    """Whether a path is one of Anthropic's routes, whose errors take Anthropic's shape."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def anthropic_error(error: APIError) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`; the param, when there is one, is named in
    the message (Anthropic's errors have no field for it)."""
    message = error.detail.message
    param = error.detail.param
    if param and param not in message:
        message = f"{message} ({param})"
    kind = _ANTHROPIC_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# The routes whose errors take this shape, for ErrorShapes.
ERROR_SHAPE = (ANTHROPIC_PREFIX, anthropic_error)
