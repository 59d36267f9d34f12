"""A table from message type to handler, so a new message is one row rather than one more
branch of an ``isinstance`` chain. Looked up by the message's exact type (msgspec decodes a
union into its exact member types): one dict lookup per message, whichever row it is."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")
M = TypeVar("M")


class Route(Generic[P, R]):
    """One row: the message type and its handler, which takes the message first."""

    __slots__ = ("handler", "message_type")

    def __init__(self, message_type: type, handler: Callable[Concatenate[Any, P], R]) -> None:
        self.message_type = message_type
        self.handler = handler


def route(message_type: type[M], handler: Callable[Concatenate[M, P], R]) -> Route[P, R]:
    """A row whose handler is checked, where the table is written, to take ``message_type``."""
    return Route(message_type, handler)


class TypeDispatcher(Generic[P, R]):
    """``dispatch(msg, *args)`` calls the handler of ``type(msg)`` with ``msg, *args``."""

    def __init__(self, routes: Iterable[Route[P, R]]) -> None:
        # Each handler was type-checked against its row's type by ``route``; the table itself
        # can only say "some message".
        self._handlers: dict[type, Callable[Concatenate[Any, P], R]] = {}
        for row in routes:
            if row.message_type in self._handlers:
                raise ValueError(f"two handlers for {row.message_type.__name__}")
            self._handlers[row.message_type] = row.handler

    @property
    def message_types(self) -> frozenset[type]:
        return frozenset(self._handlers)

    def dispatch(self, msg: object, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._handlers[type(msg)](msg, *args, **kwargs)
