"""Who is calling: the bearer-token checks, and the cache namespace a request may read and write."""

import secrets

from fastapi import Request

from kvserve.server.errors import APIError


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _matches(token: str | None, key: str | None) -> bool:
    # compare_digest takes the same time whatever the prefix match, so a key cannot be guessed by timing.
    return token is not None and key is not None and secrets.compare_digest(token.encode(), key.encode())


def check_api_key(request: Request, api_key: str | None, admin_key: str | None = None) -> None:
    """Raises a 401 unless the request carries `Authorization: Bearer <key>` with the API key or the
    admin key (or no API key is set)."""
    if api_key is None:
        return
    token = _bearer(request)
    if not (_matches(token, api_key) or _matches(token, admin_key)):
        raise APIError(
            401,
            "Missing or incorrect API key: send the header 'Authorization: Bearer <key>' "
            "with the key the server was started with (--api-key).",
            code="invalid_api_key",
        )


def check_admin_key(request: Request, api_key: str | None, admin_key: str | None) -> None:
    """Admin routes (cache reset) are open on a server without keys; once keys are set they need the
    admin key, and without one set they are closed to everyone."""
    if api_key is None and admin_key is None:
        return
    if admin_key is None:
        raise APIError(
            403,
            "This route needs the admin key, and the server has none: start it with --admin-key "
            "(or KVSERVE_ADMIN_KEY).",
            code="admin_key_required",
        )
    if not _matches(_bearer(request), admin_key):
        raise APIError(
            401,
            "Missing or incorrect admin key: send 'Authorization: Bearer <admin key>' (--admin-key).",
            code="invalid_api_key",
        )


def cache_namespace(request: Request) -> str:
    """The prefix-cache namespace of a request. Everyone shares one for now; tenant isolation will
    derive it from the caller's identity here, and everything downstream already keys on it."""
    return ""
