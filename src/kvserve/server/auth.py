"""Who is calling: the bearer-token check, and the cache namespace a request may read and write."""

import secrets

from fastapi import Request

from kvserve.server.errors import APIError


def check_api_key(request: Request, api_key: str | None) -> None:
    """Raises a 401 unless the request carries `Authorization: Bearer <api_key>` (or no key is set)."""
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # compare_digest takes the same time whatever the prefix match, so the key cannot be guessed by timing.
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(
            401,
            "Missing or incorrect API key: send the header 'Authorization: Bearer <key>' "
            "with the key the server was started with (--api-key).",
            code="invalid_api_key",
        )


def cache_namespace(request: Request) -> str:
    """The prefix-cache namespace of a request. Everyone shares one for now; tenant isolation will
    derive it from the caller's identity here, and everything downstream already keys on it."""
    return ""
