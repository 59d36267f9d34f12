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
from tokenizer_proc.parsers.mistral import MistralToolParser
from tokenizer_proc.parsers.tool_calls import ToolParser, new_call_id

__all__ = ["TOOL_PARSERS", "ToolParserFactory", "make_tool_parser", "tool_markers"]


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


def make_tool_parser(
    name: str, tool_names: frozenset[str], call_ids: Callable[[], str] = new_call_id
) -> ToolParser:
    """A new parser for one answer. ``tool_names``: the request's tools; a call to any other
    name is content (an empty set takes any name). Raises ValueError for an unknown format."""
    factory = TOOL_PARSERS.get(name)
    if factory is None:
        raise ValueError(
            f"unknown tool call parser {name!r}: expected one of {', '.join(sorted(TOOL_PARSERS))}"
        )
    return factory(tool_names, call_ids)


def tool_markers(name: str) -> tuple[str, ...]:
    """The texts the named format looks for (its tags or its marker token's text)."""
    return TOOL_PARSERS[name].MARKERS
