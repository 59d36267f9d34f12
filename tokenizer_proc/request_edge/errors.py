"""The error every request check raises: the server answers it with a 400 that names the
offending field."""

from __future__ import annotations


class RequestValidationError(ValueError):
    """A request the server refuses with 400; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
