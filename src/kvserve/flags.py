"""Dataclass fields as command-line flags, so that an option is written once: as a field.

A field of a config dataclass (EngineConfig, ServerOptions, the bench's workload specs) that the command
line sets carries a `Flag` in its metadata (see `option`): its help and how its text parses. `add_flags`
builds the argparse arguments from those fields, defaults included, and `from_flags` builds the
dataclass back from the parsed arguments.
"""

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

_METADATA_KEY = "kvserve.flag"


@dataclass(frozen=True)
class Flag:
    """How a field is written on the command line.

    `name` defaults to the field's name with dashes (--block-size for block_size). `parse` turns the
    text into the field's value; without it the field's own type (int, float or str) does, and a bool
    field is a switch that sets the opposite of its default (--no-prefix-cache clears
    enable_prefix_caching). `env` names a variable whose value, when set, is the default instead of the
    field's: a key given that way does not show in ps. `show` writes the default for the help's
    %(default)s (2GiB rather than 2147483648). `nargs` takes several values after the flag (argparse's
    "+"), each parsed alone; the field holds them as a tuple.
    """

    help: str = ""
    name: str | None = None
    parse: Callable[[str], Any] | None = None
    show: Callable[[Any], str] | None = None
    choices: Sequence[str] | None = None
    env: str | None = None
    metavar: str | None = None
    nargs: str | None = None


def option(default: Any, help: str = "", *, repr: bool = True, **flag: Any) -> Any:
    """A dataclass field with `default` that the command line sets (see `Flag` for `flag`)."""
    return field(default=default, repr=repr, metadata={_METADATA_KEY: Flag(help, **flag)})


def positive_int(text: str) -> int:
    number = int(text)
    if number < 1:
        raise ValueError(f"must be at least 1, not {number}")
    return number


def flag_name(f: "dataclasses.Field[Any]") -> str:
    flag: Flag = f.metadata[_METADATA_KEY]
    return flag.name or "--" + f.name.replace("_", "-")


def flagged_fields(cls: type, names: Iterable[str] | None = None) -> Iterator["dataclasses.Field[Any]"]:
    """The fields of `cls` that are flags: every one in declaration order, or those of `names` in
    that order (a name without a flag is a mistake of the caller, so it raises)."""
    by_name = {f.name: f for f in dataclasses.fields(cls) if _METADATA_KEY in f.metadata}
    if names is None:
        yield from by_name.values()
        return
    for name in names:
        if name not in by_name:
            raise KeyError(f"{cls.__name__}.{name} is not a command-line flag")
        yield by_name[name]


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    names: Iterable[str] | None = None,
    *,
    exclude: Iterable[str] = (),
) -> None:
    """One argument per flag field of `cls` (see `flagged_fields`), but those in `exclude`; its
    destination is the field's name."""
    skip = set(exclude)
    for f in flagged_fields(cls, names):
        if f.name in skip:
            continue
        flag: Flag = f.metadata[_METADATA_KEY]
        default = f.default
        if flag.env is not None:
            default = os.environ.get(flag.env, default)
        shown = flag.show(default) if flag.show is not None and default is not None else None
        help = flag.help if shown is None else flag.help.replace("%(default)s", shown)
        if _value_type(f) is bool:
            action = "store_false" if default else "store_true"
            parser.add_argument(flag_name(f), dest=f.name, action=action, help=help)
            continue
        parser.add_argument(
            flag_name(f),
            dest=f.name,
            type=_parser(f, flag),
            default=default,
            choices=flag.choices,
            metavar=flag.metavar,
            nargs=flag.nargs,
            help=help,
        )


def from_flags(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """`cls` built from parsed arguments: every flag field that `args` holds, then `overrides`."""
    values = {f.name: getattr(args, f.name) for f in flagged_fields(cls) if hasattr(args, f.name)}
    return cls(**{**values, **overrides})


def to_argv(cls: type, args: argparse.Namespace, names: Iterable[str]) -> list[str]:
    """The flags of `names` that `args` holds a value for (not None), written back as arguments: to
    pass what one command was given on to another (the bench's servers)."""
    argv: list[str] = []
    for f in flagged_fields(cls, names):
        value = getattr(args, f.name)
        if value is None:
            continue
        if _value_type(f) is bool:
            argv += [flag_name(f)] if value != f.default else []
        elif f.metadata[_METADATA_KEY].nargs is not None:
            argv += [flag_name(f), *map(str, value)]
        else:
            argv += [flag_name(f), str(value)]
    return argv


def _value_type(f: "dataclasses.Field[Any]") -> Any:
    """The field's type without None: int for `int | None`."""
    kind = f.type
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        kinds = [k for k in typing.get_args(kind) if k is not type(None)]
        return kinds[0] if len(kinds) == 1 else kind
    return kind


def _parser(f: "dataclasses.Field[Any]", flag: Flag) -> Callable[[str], Any]:
    if flag.parse is None:
        kind = _value_type(f)
        if kind not in (int, float, str):
            raise TypeError(f"the flag of {f.name} needs a parse function for {kind}")
        parse: Callable[[str], Any] = kind
        return parse
    own = flag.parse

    def convert(text: str) -> Any:
        # argparse would only say "invalid value"; the parse function's message says why.
        try:
            return own(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert
