"""A request's structured-output fields, in any of the dialects clients send, as one StructuredOutputs.

Accepted: OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs`
(`json`, `json_object`, `regex`, `choice`, `grammar`) and its older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`. A request may set one constraint; two are a 400 naming the second.
"""

from collections.abc import Mapping
from typing import Any

from kvserve.engine.grammar import StructuredOutputs
from kvserve.errors import InvalidRequestError

_VLLM_KEYS = ("json", "json_object", "regex", "choice", "grammar")


def _from_response_format(response_format: dict[str, Any]) -> StructuredOutputs | None:
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise InvalidRequestError(
                "response_format json_schema needs a 'json_schema' object with a 'schema' object",
                "response_format",
            )
        return StructuredOutputs(json=spec["schema"])
    raise InvalidRequestError(
        f"response_format type {kind!r} is not one of text, json_object, json_schema", "response_format"
    )


def _from_vllm(fields: dict[str, Any]) -> StructuredOutputs:
    given = {k: v for k, v in fields.items() if k in _VLLM_KEYS and v not in (None, False)}
    unknown = sorted(k for k, v in fields.items() if k not in _VLLM_KEYS and v not in (None, False))
    if unknown:
        raise InvalidRequestError(
            f"structured_outputs field {unknown[0]!r} is not supported (use one of {', '.join(_VLLM_KEYS)})",
            "structured_outputs",
        )
    return StructuredOutputs(**given)


def structured_outputs(
    response_format: dict[str, Any] | None,
    vllm: dict[str, Any] | None = None,
    guided: Mapping[str, Any] | None = None,
) -> StructuredOutputs | None:
    """The one constraint a request asks for, or None: its `response_format` (OpenAI's shape), its
    `structured_outputs` (vLLM's) and its `guided_*` fields (by kind: json, regex, choice, grammar);
    InvalidRequestError if it asks for two or names something malformed."""
    found: list[tuple[str, StructuredOutputs]] = []
    if response_format is not None:
        spec = _from_response_format(response_format)
        if spec is not None:
            found.append(("response_format", spec))
    if vllm is not None:
        found.append(("structured_outputs", _from_vllm(vllm)))
    for key, value in (guided or {}).items():
        if value is not None:
            found.append((f"guided_{key}", StructuredOutputs(**{key: value})))
    if len(found) > 1:
        raise InvalidRequestError(
            f"{found[1][0]} conflicts with {found[0][0]}: a request takes one output constraint", found[1][0]
        )
    return found[0][1] if found else None
