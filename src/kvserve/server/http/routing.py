"""An API's routes by the access they ask of their callers, for app.py to mount and the gate to check.

Each router's routes ask one access, checked by the gate (server/http/middleware.py) before the app reads
a byte of the body: `api`'s take a key and one of its tenant's in-flight slots, and parse their bodies
with bounds (server/http/json_body.py).
"""

from dataclasses import dataclass, field

from fastapi import APIRouter

from kvserve.server.http.json_body import JSONBounds, bounded_route
from kvserve.server.http.middleware import Access


@dataclass(frozen=True)
class Routers:
    public: APIRouter = field(default_factory=APIRouter)
    keyed: APIRouter = field(default_factory=APIRouter)
    api: APIRouter = field(default_factory=lambda: APIRouter(route_class=bounded_route(JSONBounds())))
    admin: APIRouter = field(default_factory=APIRouter)

    def by_access(self) -> tuple[tuple[APIRouter, Access], ...]:
        return (
            (self.public, Access.OPEN),
            (self.keyed, Access.KEY),
            (self.api, Access.TENANT),
            (self.admin, Access.ADMIN),
        )
