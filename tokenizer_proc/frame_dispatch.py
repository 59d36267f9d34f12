"""A table from a frame's type to its handler, as SGLang's ``TypeBasedDispatcher``: a new
message is one row, and dispatching a frame costs one dict lookup on its type."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")
F = TypeVar("F")


class FrameDispatch(Generic[T]):
    """Calls the handler of each frame's exact type (``T``: the union the socket decodes)."""

    def __init__(self) -> None:
        # Each row's handler takes the row's type: ``on`` checks the pair when it is added.
        self._handlers: dict[type, Callable[..., None]] = {}

    def on(self, kind: type[F], handler: Callable[[F], None]) -> FrameDispatch[T]:
        """Adds the row ``kind`` → ``handler``; returns the table, so rows chain."""
        self._handlers[kind] = handler
        return self

    def __call__(self, frame: T) -> None:
        handler = self._handlers.get(type(frame))
        if handler is None:
            raise TypeError(f"no handler for a {type(frame).__name__} frame")
        handler(frame)
