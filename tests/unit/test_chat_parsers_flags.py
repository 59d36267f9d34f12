"""The chat parser flags (pipeline/config.py) name exactly the parsers tokenizer_proc/parsers
registers: pipeline/ cannot import them, so the two lists are kept equal here. And a parser
whose marker is a special token of the served tokenizer keeps special tokens in the text."""

from __future__ import annotations

import shutil
import typing

import pytest
import tokenizers

from pipeline.config import ReasoningParserName, ServerConfig, ToolCallParserName
from pipeline.tokenizer_loader import DEFAULT_TOKENIZER_DIR, LoadedTokenizer, load_tokenizer
from tokenizer_proc.openai.chat_parsing import ChatParsing
from tokenizer_proc.openai.tools import ChatTool, FunctionDefinition, ToolPlan, plan_tools
from tokenizer_proc.parsers.reasoning import REASONING_PARSERS
from tokenizer_proc.parsers.tool_parsers import TOOL_PARSERS


def test_the_flags_choices_are_the_registered_parsers() -> None:
    assert set(typing.get_args(ToolCallParserName)) == set(TOOL_PARSERS)
    assert set(typing.get_args(ReasoningParserName)) == set(REASONING_PARSERS)


def test_the_built_in_template_speaks_hermes_and_no_reasoning_parser_runs_by_default() -> None:
    config = ServerConfig()
    assert config.tool_call_parser == "hermes" and config.reasoning_parser is None


@pytest.fixture(scope="module")
def mistral_like(tmp_path_factory: pytest.TempPathFactory) -> LoadedTokenizer:
    """The built-in tokenizer with Mistral's ``[TOOL_CALLS]`` and Llama 3's
    ``<|python_tag|>`` as special tokens, and Qwen3's ``<think>`` as a plain added one."""
    directory = tmp_path_factory.mktemp("tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_TOKENIZER_DIR / name, directory / name)
    tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_tokens([tokenizers.AddedToken("<think>", special=False, normalized=False)])
    tokenizer.add_special_tokens(
        [
            tokenizers.AddedToken(t, special=True, normalized=False)
            for t in ("[TOOL_CALLS]", "<|python_tag|>")
        ]
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    return load_tokenizer(directory)


def _plan(mode: str) -> ToolPlan:
    plan = plan_tools(
        [ChatTool(type="function", function=FunctionDefinition(name="f"))], mode, None
    )  # type: ignore[arg-type]
    assert plan is not None
    return plan


@pytest.mark.parametrize(
    ("parser", "mode", "reasoning", "keeps"),
    [
        ("mistral", "auto", None, True),  # [TOOL_CALLS] is one special token: kept for the parser
        ("llama3_json", "auto", None, True),
        ("hermes", "auto", None, False),  # <tool_call> is plain text in this tokenizer
        ("mistral", "required", None, False),  # a forced answer is bare JSON: no marker to read
        ("mistral", "none", None, False),
        ("hermes", "auto", "qwen3", False),  # <think> is added, not special
    ],
)
def test_special_tokens_stay_in_the_text_only_where_a_marker_is_one(
    mistral_like: LoadedTokenizer, parser: str, mode: str, reasoning: str | None, keeps: bool
) -> None:
    parsing = ChatParsing(_plan(mode), parser, reasoning)
    assert parsing.keeps_special_tokens(mistral_like.is_special_text) is keeps
    assert mistral_like.is_special_text("[TOOL_CALLS]") and not mistral_like.is_special_text(
        "<think>"
    )
    assert not mistral_like.is_special_text("[TOOL_CALLS] ")  # not one token
