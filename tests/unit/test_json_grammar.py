"""The grammars the scheduler compiles, fed byte by byte (scheduler_proc/sampling/json_grammar.py,
grammar.py's ``compile_spec``): every JSON string is strict RFC 8259 (no raw control
character, no encoded surrogate), the whitespace between tokens is bounded or absent as the
options say, and a grammar whose language is empty is refused when it compiles.

The vocabulary is the 256 bytes and a stop token, so a test spells any byte string and asks
the matcher whether it takes it whole."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar as xgr

from pipeline.io_struct import Constraint
from scheduler_proc.sampling.grammar import GrammarCompiler, GrammarError, Key, compile_spec
from scheduler_proc.sampling.json_grammar import JsonOptions

STOP = 256
ENGINE = xgr.GrammarCompiler(
    xgr.TokenizerInfo(
        [bytes([b]) for b in range(256)] + [b"</s>"],
        vocab_type=xgr.VocabType.RAW,
        stop_token_ids=[STOP],
    ),
    cache_enabled=False,
)
BOUNDED = 24  # the server's default bound (--constrained-json-max-whitespace)


def compiled(
    kind: str, spec: str, any_whitespace: bool = True, options: JsonOptions | None = None
) -> xgr.CompiledGrammar:
    outcome = compile_spec(ENGINE, Key(kind, spec, any_whitespace), options or JsonOptions())
    assert not isinstance(outcome, GrammarError), outcome
    return outcome


def takes(grammar: xgr.CompiledGrammar, text: bytes | str) -> bool:
    """Whether the grammar takes ``text`` whole, and then the end."""
    data = text.encode() if isinstance(text, str) else text
    matcher = xgr.GrammarMatcher(grammar)
    return all(matcher.accept_token(b) for b in data) and matcher.accept_token(STOP)


def schema(value: dict[str, Any]) -> xgr.CompiledGrammar:
    return compiled("json_schema", json.dumps(value))


# Each holds a string at "@": the document with the string "ab@" in its place.
STRINGS: dict[str, tuple[xgr.CompiledGrammar, str]] = {
    "maxLength": (schema({"type": "string", "maxLength": 8}), "@"),
    "minLength": (schema({"type": "string", "minLength": 1}), "@"),
    "plain": (schema({"type": "string"}), "@"),
    "in an array": (schema({"type": "array", "items": {"type": "string", "maxLength": 5}}), "[@]"),
    "json_object key": (compiled("json_object", ""), "{@: 1}"),
    "json_object value": (compiled("json_object", ""), '{"k": @}'),
    "pattern": (schema({"type": "string", "pattern": "^.{0,8}$"}), "@"),
}


# Where a string takes escapes: xgrammar writes a bounded one, or one with a pattern, as
# characters alone (no quote, backslash or control character in it at all).
ESCAPED = ("plain", "json_object key", "json_object value")


@pytest.mark.parametrize("where", list(STRINGS))
def test_no_json_string_takes_a_raw_control_character(where: str) -> None:
    """xgrammar 0.2.9 lets a bounded string take U+0000-U+001F raw (not JSON); here every
    string refuses each of them, and the strings that take escapes take it escaped."""
    grammar, document = STRINGS[where]
    assert takes(grammar, document.replace("@", '"ab"'))
    for code in range(0x20):
        assert not takes(grammar, document.replace("@", f'"ab{chr(code)}"')), (where, code)
        escaped = takes(grammar, document.replace("@", '"ab' + f"\\u{code:04x}" + '"'))
        assert escaped == (where in ESCAPED), (where, code)


def test_a_bounded_string_counts_its_characters_and_takes_no_escape() -> None:
    grammar = schema({"type": "string", "minLength": 2, "maxLength": 3})
    assert takes(grammar, '"ab"') and takes(grammar, '"a\x7fé"') and takes(grammar, '"😀😀😀"')
    assert not takes(grammar, '"a"') and not takes(grammar, '"abcd"')
    assert not takes(grammar, r'"a\n"') and not takes(grammar, '"a\\"')


@pytest.mark.parametrize("where", ["maxLength", "plain", "json_object value"])
def test_no_string_takes_an_encoded_surrogate(where: str) -> None:
    """ED A0-BF xx encodes a UTF-16 surrogate (not UTF-8); ED 80-9F xx is a character."""
    grammar, document = STRINGS[where]
    before, after = (part.encode() for part in document.split("@"))
    assert not takes(grammar, before + b'"a\xed\xa0\x80"' + after)
    assert not takes(grammar, before + b'"a\xed\xbf\xbf"' + after)
    assert takes(grammar, before + '"a\ud7ff\ue000😀"'.encode() + after)


OBJECT = json.dumps(
    {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "array", "items": {"type": "integer"}},
        },
        "required": ["a", "b"],
    }
)


def test_whitespace_between_tokens_is_bounded_by_the_option() -> None:
    bounded = compiled("json_schema", OBJECT, options=JsonOptions(max_whitespace=BOUNDED))
    pretty = json.dumps({"a": 1, "b": [1, 2]}, indent=4)
    assert takes(bounded, pretty)
    for gap in (" " * BOUNDED, "\n" + "\t" * (BOUNDED - 1), "\r\n" + " " * (BOUNDED - 2)):
        assert takes(bounded, '{"a":' + gap + '1, "b": [' + gap + "]" + gap + "}")
        assert not takes(bounded, '{"a":' + gap + ' 1, "b": []}')  # one more
    free = compiled("json_schema", OBJECT, options=JsonOptions(max_whitespace=0))
    assert takes(free, '{"a":' + " " * 1000 + '1, "b": []}')


@pytest.mark.parametrize(
    ("any_whitespace", "options"),
    [(False, JsonOptions(max_whitespace=BOUNDED)), (True, JsonOptions(any_whitespace=False))],
    ids=["disable_any_whitespace", "--constrained-json-disable-any-whitespace"],
)
def test_compact_json_has_one_layout(any_whitespace: bool, options: JsonOptions) -> None:
    """As vLLM and SGLang compile it with xgrammar: ", " and ": ", no other whitespace."""
    for kind, spec in (("json_schema", OBJECT), ("json_object", "")):
        grammar = compiled(kind, spec, any_whitespace, options)
        assert takes(grammar, '{"a": 1, "b": [1, 2]}')
        assert not takes(grammar, '{"a":1, "b": [1, 2]}')
        assert not takes(grammar, '{ "a": 1, "b": [1, 2]}')
        assert not takes(grammar, '{"a": 1, "b": [1, 2]}\n')


def test_the_compile_key_holds_whitespace_for_the_json_kinds_only() -> None:
    compiler = GrammarCompiler(
        lambda: ENGINE.tokenizer_info, {STOP}, json_options=JsonOptions(), timeout=5.0
    )
    try:
        loose = compiler.key(Constraint("json_schema", OBJECT, "p"))
        compact = compiler.key(Constraint("json_schema", OBJECT, "p", any_whitespace=False))
        assert loose != compact and loose.any_whitespace and not compact.any_whitespace
        regex = Constraint("regex", "a+", "p")
        assert compiler.key(regex) == compiler.key(Constraint("regex", "a+", "q", False))
    finally:
        compiler.close()


EMPTY_LANGUAGES = [
    ("grammar", "root ::= root"),
    ("grammar", "root ::= [^\\x00-\\U0010FFFF]"),
    ("grammar", 'root ::= x\nx ::= x "a"'),
    ("regex", "[^\\s\\S]"),
]


@pytest.mark.parametrize(("kind", "spec"), EMPTY_LANGUAGES)
def test_a_grammar_that_matches_nothing_is_refused_when_it_compiles(kind: str, spec: str) -> None:
    outcome = compile_spec(ENGINE, Key(kind, spec, True), JsonOptions())
    assert isinstance(outcome, GrammarError) and "matches nothing" in str(outcome), outcome


def test_a_grammar_of_the_empty_answer_alone_is_not_empty() -> None:
    grammar = compiled("grammar", 'root ::= ""')
    assert takes(grammar, "") and not takes(grammar, "a")
