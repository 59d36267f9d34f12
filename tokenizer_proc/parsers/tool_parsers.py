"""The tool-call formats by name, as ``--tool-call-parser`` names them in vLLM and SGLang.

Apart from ``tool_calls.py`` because the formats import its types: the registry there would
make a circle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Protocol

from tokenizer_proc.parsers.hermes import HermesToolParser
from tokenizer_proc.parsers.llama3_json import Llama3JsonToolParser
from tokenizer_proc.parsers.mistral import MistralToolParser, mistral_call_id
from tokenizer_proc.parsers.tool_calls import ToolParser, new_call_id

__all__ = [
    "TOOL_PARSERS",
    "ToolParserFactory",
    "format_call_ids",
    "make_tool_parser",
    "tool_markers",
]


class ToolParserFactory(Protocol):
    """A parser class of this package: ``(tool_names, call_ids) -> parser``, and the texts
    it looks for in an answer."""

    @property
    def MARKERS(self) -> tuple[str, ...]: ...  # noqa: N802 - the classes' attribute

    def __call__(
        self, tool_names: frozenset[str], call_ids: Callable[[], str], /
    ) -> ToolParser: ...


TOOL_PARSERS: Mapping[str, ToolParserFactory] = MappingProxyType(
    {
        "hermes": HermesToolParser,
        "llama3_json": Llama3JsonToolParser,
        "mistral": MistralToolParser,
    }
)


# The formats whose templates take only ids of their own shape; the others get OpenAI's.
_CALL_IDS: Mapping[str, Callable[[], str]] = MappingProxyType({"mistral": mistral_call_id})


def make_tool_parser(
    name: str, tool_names: frozenset[str], call_ids: Callable[[], str] | None = None
) -> ToolParser:
    """A new parser for one answer. ``tool_names``: the request's tools; a call to any other
    name is content (an empty set takes any name); ``call_ids``: the calls' ids (None: the
    format's, ``format_call_ids``). Raises ValueError for an unknown format."""
    factory = TOOL_PARSERS.get(name)
    if factory is None:
        raise ValueError(
            f"unknown tool call parser {name!r}: expected one of {', '.join(sorted(TOOL_PARSERS))}"
        )
    return factory(tool_names, call_ids if call_ids is not None else format_call_ids(name))


def format_call_ids(name: str) -> Callable[[], str]:
    """The call ids a server of the named format gives, for every ``tool_choice``: its model's
    template reads them back on the next turn. Mistral's take 9 letters and digits only
    (``mistral_call_id``); the others OpenAI's ``call_`` shape (``new_call_id``)."""
    return _CALL_IDS.get(name, new_call_id)


def tool_markers(name: str) -> tuple[str, ...]:
    """The texts the named format looks for (its tags or its marker token's text)."""
    return TOOL_PARSERS[name].MARKERS
