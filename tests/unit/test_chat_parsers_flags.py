"""The chat parser flags (pipeline/config.py) name exactly the parsers tokenizer_proc/parsers
registers: pipeline/ cannot import them, so the two lists are kept equal here."""

from __future__ import annotations

import typing

from pipeline.config import ReasoningParserName, ServerConfig, ToolCallParserName
from tokenizer_proc.parsers.reasoning import REASONING_PARSERS
from tokenizer_proc.parsers.tool_parsers import TOOL_PARSERS


def test_the_flags_choices_are_the_registered_parsers() -> None:
    assert set(typing.get_args(ToolCallParserName)) == set(TOOL_PARSERS)
    assert set(typing.get_args(ReasoningParserName)) == set(REASONING_PARSERS)


def test_the_built_in_template_speaks_hermes_and_no_reasoning_parser_runs_by_default() -> None:
    config = ServerConfig()
    assert config.tool_call_parser == "hermes" and config.reasoning_parser is None
