"""Request bodies parsed with bounds, straight from the bytes.

A route's body model is validated from the bytes in pydantic's JSON mode (`model_validate_json`): fields the
model does not know are skipped without a Python object made for them (the standard json module made a dict
or list for every `{}` of an ignored field). pydantic-core still parses the whole body into its own tree
before validating (freed at once), and refuses nesting over 200 levels. So the bytes are counted first, in
one linear pass: JSON containers (`[` and `{`) and values (each value but the first of a container follows a
comma, so values are at most commas + containers + 1) outside strings. Counting bytes is C-speed; strings
are masked out (a regex, also linear) only when the raw counts, which include the strings' own commas and
brackets, are over a bound. `docs/security.md` (*Limits on one request*) states the memory this bounds.
"""

import re
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from kvserve.errors import InvalidRequestError
from kvserve.server.http.errors import BodyError, bad_request, validation_error

# A JSON string from its opening quote to its closing one, or to the end of the body when it has none:
# every attempt that starts at a quote succeeds, so masking never backtracks (linear in the body).
_STRING = re.compile(rb'"[^"\\]*+(?:\\[\s\S]?+[^"\\]*+)*+(?:"|\Z)')
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class JSONBounds:
    """The most containers (arrays and objects) and values (containers and scalars) one body may hold.

    Each value costs pydantic-core's tree node and a Python object while it is parsed and read, so the
    values bound the memory of a body the bytes do not (docs/security.md, *Limits on one request*, has
    the cost per value). 100,000 token-id prompts (a batch the sequence cap
    refuses by name) are 100,001 arrays and 300,002 values; a vocabulary-wide logit_bias of 262,144
    entries is 262,146 values."""

    max_containers: int = 2**17
    max_values: int = 2**19


def _counts(body: bytes) -> tuple[int, int]:
    containers = body.count(b"[") + body.count(b"{")
    return containers, body.count(b",") + containers + 1


def check_shape(body: bytes, bounds: JSONBounds) -> None:
    """A 400 when the body holds more JSON containers or values than `bounds` allow."""
    containers, values = _counts(body)
    if containers > bounds.max_containers or values > bounds.max_values:
        # The raw counts include the strings' own brackets and commas: count again without them.
        containers, values = _counts(_STRING.sub(b'""', body))
    if containers > bounds.max_containers:
        raise InvalidRequestError(
            f"The request body holds {containers} JSON arrays and objects; this server reads at most "
            f"{bounds.max_containers} in one request.",
            code="request_too_complex",
        )
    if values > bounds.max_values:
        raise InvalidRequestError(
            f"The request body holds about {values} JSON values; this server reads at most "
            f"{bounds.max_values} in one request.",
            code="request_too_complex",
        )


def parse_body(body: bytes, model: type[M], bounds: JSONBounds) -> M:
    """`body` as `model`, counted (check_shape) and then validated from its bytes; a BodyError (a 400,
    its message the one a validation error gets) when it is not one."""
    try:
        check_shape(body, bounds)
    except InvalidRequestError as e:
        raise BodyError(bad_request(e)) from None
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        # Located as FastAPI locates a body's errors, so that they read as they always have.
        errors = [
            {**error, "loc": ("body", *error["loc"])}
            for error in e.errors(include_url=False, include_input=False, include_context=True)
        ]
        raise BodyError(validation_error(errors)) from None


class _BoundedRequest(Request):
    """A request whose JSON body is its route's model, parsed by `parse_body`. FastAPI reads a body as
    JSON only when its content type says so, and then validates the model instance it gets (as is)."""

    def __init__(self, request: Request, model: type[BaseModel], bounds: JSONBounds) -> None:
        super().__init__(request.scope, request.receive)
        self._model = model
        self._bounds = bounds

    async def json(self) -> Any:
        return parse_body(await self.body(), self._model, self._bounds)


def bounded_route(bounds: JSONBounds) -> type[APIRoute]:
    """The route class of a router whose bodies are parsed by `parse_body` under `bounds`."""

    class BoundedJSONRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()
            body = self.body_field
            model = body.field_info.annotation if body is not None else None
            if not (isinstance(model, type) and issubclass(model, BaseModel)):
                return handler
            body_model: type[BaseModel] = model

            async def bounded(request: Request) -> Response:
                return await handler(_BoundedRequest(request, body_model, bounds))

            return bounded

    return BoundedJSONRoute
