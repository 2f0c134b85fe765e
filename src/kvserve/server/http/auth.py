"""Who is calling: the key (a bearer token, or Anthropic's `x-api-key` header) names a tenant (or is the
operator's admin key), and the tenant (not the client) picks the cache namespace that a request may read
and write."""

import secrets
from dataclasses import dataclass

from fastapi import Request
from starlette.datastructures import Headers

from kvserve.server.http.errors import APIError
from kvserve.server.http.tenants import Tenant, Tenants

# The admin key's own tenant: '@' cannot appear in a key file's tenant names, so no tenant shares it.
ADMIN_TENANT = Tenant("@admin")


@dataclass(frozen=True)
class Caller:
    tenant: Tenant
    tenants: Tenants
    is_admin: bool = False

    def namespace(self, cache_salt: str | None) -> str:
        return self.tenants.namespace(self.tenant, cache_salt)


def _bearer(headers: Headers) -> str | None:
    """The key a request carries: `Authorization: Bearer <key>` (OpenAI's clients), else
    `x-api-key: <key>` (Anthropic's). Either names the same tenants."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    # No key is empty (tenants.check_key), so neither is a token that could match one.
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key", "").strip() or None


def _is_admin_key(token: str | None, admin_key: str | None) -> bool:
    # compare_digest takes the same time whatever the prefix match, so the key cannot be guessed by timing.
    if token is None or admin_key is None:
        return False
    return secrets.compare_digest(token.encode(), admin_key.encode())


def authenticate(headers: Headers, tenants: Tenants) -> Caller:
    """The caller of a request, from its headers alone (the gate, server/http/middleware.py, keeps it on
    `request.state`); a 401 unless it carries `Authorization: Bearer <key>` with a key of the server (or
    the server has no keys). The admin key is accepted too, as its own tenant."""
    token = _bearer(headers)
    if _is_admin_key(token, tenants.admin_key):
        return Caller(ADMIN_TENANT, tenants, is_admin=True)
    tenant = tenants.authenticate(token)
    if tenant is None:
        raise APIError(
            401,
            "Missing or incorrect API key: send the header 'Authorization: Bearer <key>' (or "
            "'x-api-key: <key>') with a key the server was started with (--api-key or --api-key-file).",
            code="invalid_api_key",
        )
    return Caller(tenant, tenants)


def check_admin_key(headers: Headers, tenants: Tenants) -> None:
    """Admin routes (cache reset) are open on a server without keys; once keys are set they need the
    admin key, and without one set they are closed to everyone."""
    admin_key = tenants.admin_key
    if tenants.single_tenant and admin_key is None:
        return
    if admin_key is None:
        raise APIError(
            403,
            "This route needs the admin key, and the server has none: start it with --admin-key "
            "(or KVSERVE_ADMIN_KEY).",
            code="admin_key_required",
        )
    if not _is_admin_key(_bearer(headers), admin_key):
        raise APIError(
            401,
            "Missing or incorrect admin key: send 'Authorization: Bearer <admin key>' (--admin-key).",
            code="invalid_api_key",
        )


def caller(request: Request) -> Caller:
    known: Caller = request.state.caller
    return known


def cache_namespace(request: Request, cache_salt: str | None = None) -> str:
    """The prefix-cache namespace of a request: its tenant's (or shared group's), split by its
    cache_salt if it sends one. Nothing a client sends can name another tenant's."""
    return caller(request).namespace(cache_salt)


def stats_scope(request: Request) -> str | None:
    """Which namespace a caller may watch on the dashboard: all (None) for the admin key or a server
    without keys, otherwise only its own tenant's."""
    who = caller(request)
    if who.is_admin or who.tenants.single_tenant:
        return None
    return who.namespace(None)
