"""Chat templates rendered with jinja2 alone, as transformers' `apply_chat_template(..., tokenize=False)`
renders them, so that serving never imports transformers (about a second and a half of every start).

What the template sees is what transformers gives it: the messages with their None-valued keys dropped
and their reasoning under every name templates read it by, the tools, `add_generation_prompt`, the
tokenizer's special tokens by name, and the caller's variables, each rebuilt from plain JSON types; in
an immutable sandbox that trims blocks, with loop controls, a `{% generation %}` block that renders its
body, a `tojson` that keeps non-ASCII text and takes indents, `raise_exception`, `strftime_now`, and
`dict` and `namespace` that refuse underscore names. tests/model/test_chat_template.py holds it equal to
transformers on templates of several families.
"""

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The names a message's reasoning goes by; the first is the one templates read, gpt-oss's read "thinking".
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Compiled templates kept (the model's own and a --chat-template: a handful).
_COMPILED = 16


def pick_template(own: str | Mapping[str, str] | None, source: str | None, has_tools: bool) -> str:
    """The template to render: `source` (or the name of one of the model's own), else the model's own
    (its "tool_use" one when tools are given and it has one). ValueError where there is none."""
    if isinstance(own, Mapping):
        if source is not None:
            return own.get(source, source)
        if has_tools and "tool_use" in own:
            return own["tool_use"]
        if "default" in own:
            return own["default"]
        raise ValueError(f"the model has several chat templates and no default one: {sorted(own)}")
    if source is not None:
        return source
    if own is None:
        raise ValueError("the model has no chat template")
    return own


def render(
    template: str,
    messages: Sequence[Any],
    tools: Sequence[Any] | None,
    add_generation_prompt: bool,
    variables: Mapping[str, Any],
) -> str:
    """`template` rendered on `messages`; `variables` are the special tokens by name and the caller's own
    (the caller's win). Raises TypeError or ValueError for messages or tools of the wrong shape, and
    whatever the template raises."""
    if not messages:
        raise ValueError("cannot render an empty conversation")
    chat = []
    for message in _as_dicts(list(messages)):
        if not isinstance(message, dict):
            raise TypeError(f"a chat message must be a mapping, not {type(message).__name__}")
        chat.append({k: v for k, v in message.items() if v is not None})
    if tools is not None:
        for tool in tools:
            if not isinstance(tool, dict):
                raise ValueError("a tool must be a JSON schema (a mapping)")
    compiled = _compile(template)
    return compiled.render(
        messages=_with_reasoning_aliases(_plain(chat)),
        tools=_plain(None if tools is None else list(tools)),
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **_plain(dict(variables)),
    )


def _as_dicts(value: Any) -> Any:
    """Message objects (dataclasses, pydantic models) and everything nested in them as dicts and lists."""
    if isinstance(value, Mapping):
        return {k: _as_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_as_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _as_dicts(value.model_dump())
    return value


def _plain(value: Any) -> Any:
    """`value` rebuilt of JSON types only (a subclass of str or int carries methods the sandbox does not
    know); anything else becomes a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    item = getattr(value, "item", None)
    if type(value).__module__ == "numpy" and callable(item):
        return _plain(item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _with_reasoning_aliases(chat: list[Any]) -> list[Any]:
    """Each message's reasoning under "reasoning_content" and "thinking" too, from whichever name it came."""
    out = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's text for training masks; renders
    its body."""

    tags = {"generation"}  # noqa: RUF012 (jinja reads it from the class)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Not jinja's own: that one escapes HTML characters, which a prompt must keep.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Dict:
    """`dict(...)` in a template, without the class's attributes to reach through."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing attributes that start with an underscore (CPython's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # jinja's own signature trick: `namespace(self=...)` stays a plain attribute.
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a template may not set the namespace attribute {name!r}")


@lru_cache(maxsize=_COMPILED)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env.from_string(template)
