"""Command-line flags generated from a msgspec ``Struct``'s annotated fields, so each setting
is declared once: its name, type and default on the field, its help and flag details in the
``Annotated`` marker beside them (``Flag``, or ``NoFlag`` for a field deliberately not on the
command line; ``field_flags`` refuses a field with neither).

The generated arguments store each value under the field's name, so the struct is built from
the parsed namespace field by field.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import msgspec

S = TypeVar("S", bound=msgspec.Struct)


@dataclass(frozen=True)
class Flag:
    """The field is a flag, ``--field-name`` unless spelled otherwise. The flag's type follows
    the field's: ``int``, ``float`` and ``str`` (optional or not) parse as such, a ``Literal``
    gives the choices, and a ``bool`` is a switch: a field that defaults to False is set by
    its flag (``store_true``), one that defaults to True needs a spelling that says so, such
    as ``--disable-metrics``, and is cleared by it."""

    group: str  # the --help section it is listed under
    help: str | None = None  # None only with hidden=True
    spelling: str | None = None  # default: --field-name
    parse: Callable[[str], Any] | None = None  # instead of the type the field's annotation gives
    env: str | None = None  # read when the flag is absent or empty
    hidden: bool = False  # accepted, but not listed by --help
    nargs: str | None = None  # "+": the flag takes one or more values (a tuple field)

    def option(self, field: str) -> str:
        return self.spelling or "--" + field.replace("_", "-")


@dataclass(frozen=True)
class NoFlag:
    """The field is deliberately not on the command line: set by the environment, or by the
    supervisor for each child."""

    why: str
    env: str | None = None  # read into the field; without it the field keeps its default


@dataclass(frozen=True)
class FieldFlag:
    """One field's declaration, resolved: what ``add_flags`` and ``from_args`` work from."""

    name: str
    annotation: Any  # the field's type without its Annotated markers
    default: Any
    marker: Flag | NoFlag

    @property
    def spelling(self) -> str | None:
        return self.marker.option(self.name) if isinstance(self.marker, Flag) else None


def field_flags(struct: type[msgspec.Struct]) -> list[FieldFlag]:
    """Every field of ``struct`` in declaration order, with its marker. A field without
    exactly one ``Flag`` or ``NoFlag`` is a mistake in the declaration: TypeError."""
    hints = typing.get_type_hints(struct, include_extras=True)
    found = []
    for field in msgspec.structs.fields(struct):
        hint = hints[field.name]
        extras = hint.__metadata__ if typing.get_origin(hint) is typing.Annotated else ()
        markers = [m for m in extras if isinstance(m, (Flag, NoFlag))]
        if len(markers) != 1:
            raise TypeError(
                f"{struct.__name__}.{field.name} needs exactly one Flag(...) or NoFlag(...) "
                f"marker, has {len(markers)}"
            )
        annotation = typing.get_args(hint)[0] if extras else hint
        found.append(FieldFlag(field.name, annotation, field.default, markers[0]))
    return found


def _without_none(annotation: Any) -> Any:
    """``int | None`` -> ``int``; anything else as it is."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        rest = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def add_flags(parser: argparse.ArgumentParser, struct: type[msgspec.Struct]) -> None:
    """One argument per ``Flag`` field of ``struct``, under its group, in field order."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in field_flags(struct):
        if not isinstance(f.marker, Flag):
            continue
        flag = f.marker
        if flag.help is None and not flag.hidden:
            raise TypeError(f"{struct.__name__}.{f.name}: a listed flag needs help text")
        if flag.group not in groups:
            groups[flag.group] = parser.add_argument_group(flag.group)
        group = groups[flag.group]
        option = flag.option(f.name)
        settings: dict[str, Any] = {
            "dest": f.name,
            "default": f.default,
            "help": argparse.SUPPRESS if flag.hidden else flag.help,
        }
        kind = _without_none(f.annotation)
        if kind is bool:
            if f.default and flag.spelling is None:
                raise TypeError(
                    f"{struct.__name__}.{f.name} defaults to True: "
                    "its flag needs a spelling that clears it"
                )
            settings["action"] = "store_false" if f.default else "store_true"
        elif typing.get_origin(kind) is Literal:
            settings["choices"] = list(typing.get_args(kind))
        elif flag.parse is not None:
            settings["type"] = flag.parse
        elif kind in (int, float):
            settings["type"] = kind
        if flag.nargs is not None:
            settings["nargs"] = flag.nargs
        group.add_argument(option, **settings)


def from_args(
    struct: type[S], args: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> S:
    """``struct`` from a namespace ``add_flags`` parsed, with the environment variables the
    markers name filling in where a flag is absent or empty."""
    values = {}
    for f in field_flags(struct):
        env = f.marker.env
        if isinstance(f.marker, NoFlag):
            values[f.name] = f.default if env is None else environ.get(env, f.default)
        else:
            value = getattr(args, f.name)
            values[f.name] = environ.get(env, f.default) if env is not None and not value else value
    return struct(**values)
