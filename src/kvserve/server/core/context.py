"""ServerContext: what every route needs, built once by `create_app` and shared by the route modules."""

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from kvserve.engine.async_engine import AsyncEngine
from kvserve.options import ServerOptions
from kvserve.server.core.cache_report import MissLog
from kvserve.server.core.chat_setup import ChatSetup
from kvserve.server.core.preparation import PreparationPool
from kvserve.server.core.prompts import PromptGuard
from kvserve.server.http.errors import APIError
from kvserve.server.http.metrics import ServerMetrics
from kvserve.server.http.middleware import InFlightLimiter
from kvserve.server.http.tenants import Tenants


@dataclass(frozen=True)
class ServerContext:
    """What every route needs: the engine's door, the served model's name and limits, metrics, the
    tenants (with the admin key) and the server's options, the two checks only the server makes
    (`in_flight`, `prompt_guard`), the threads that prepare requests, by tenant (`preparation`), the
    chat template with its tool and reasoning formats (`chat`), and the log of cache misses
    (`misses`). An API's own state (the Responses API's stored responses) is its own, kept beside it by
    app.py. `model_name` is the name answers show, `model_names` every name a request may send (it and
    its aliases)."""

    async_engine: AsyncEngine
    model_name: str
    model_names: frozenset[str]
    max_model_len: int
    metrics: ServerMetrics
    tenants: Tenants
    created: int
    in_flight: InFlightLimiter
    prompt_guard: PromptGuard
    options: ServerOptions
    preparation: PreparationPool
    chat: ChatSetup
    # Each namespace's last misses and the response ids a cache diagnosis may compare with.
    misses: MissLog = field(default_factory=MissLog)


def _context(request: Request) -> ServerContext:
    context: ServerContext = request.app.state.context
    return context


# A route's parameter: the app's ServerContext (create_app puts it in app.state).
Context = Annotated[ServerContext, Depends(_context)]


def check_model(ctx: ServerContext, model: str | None) -> None:
    """A request may name the served model, one of its aliases, or none at all; any other name is a 404,
    as OpenAI answers."""
    if model and model not in ctx.model_names:
        raise APIError(
            404,
            f"The model '{model}' does not exist; this server serves '{ctx.model_name}' (GET /v1/models).",
            param="model",
            code="model_not_found",
        )
