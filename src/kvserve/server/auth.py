"""Who is calling: the bearer token names a tenant, and the tenant (not the client) picks the cache
namespace that a request may read and write."""

from dataclasses import dataclass

from fastapi import Request

from kvserve.server.errors import APIError
from kvserve.server.tenants import Tenant, Tenants


@dataclass(frozen=True)
class Caller:
    tenant: Tenant
    tenants: Tenants

    def namespace(self, cache_salt: str | None) -> str:
        return self.tenants.namespace(self.tenant, cache_salt)


def authenticate(request: Request, tenants: Tenants) -> Caller:
    """The caller of a request, kept on `request.state`; a 401 unless it carries
    `Authorization: Bearer <key>` with a key of the server (or the server has no keys)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    tenant = tenants.authenticate(token.strip() if scheme.lower() == "bearer" else None)
    if tenant is None:
        raise APIError(
            401,
            "Missing or incorrect API key: send the header 'Authorization: Bearer <key>' "
            "with a key the server was started with (--api-key or --api-key-file).",
            code="invalid_api_key",
        )
    caller = Caller(tenant, tenants)
    request.state.caller = caller
    return caller


def caller(request: Request) -> Caller:
    known: Caller = request.state.caller
    return known


def cache_namespace(request: Request, cache_salt: str | None = None) -> str:
    """The prefix-cache namespace of a request: its tenant's (or shared group's), split by its
    cache_salt if it sends one. Nothing a client sends can name another tenant's."""
    return caller(request).namespace(cache_salt)
