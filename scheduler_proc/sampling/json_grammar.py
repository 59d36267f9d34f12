"""JSON Schema grammars as tokenpipe compiles them (docs/design/structured-outputs.md):
xgrammar's own conversion, made strict where xgrammar 0.2.9 is not, with whitespace bounded.

xgrammar writes a string with ``minLength``/``maxLength`` as so many "characters other than
quote, backslash and line ends": a raw control character gets in (not JSON: RFC 8259 wants it
escaped). Here it is so many characters other than quote, backslash, control characters and
UTF-16 surrogates (bytes ED A0-BF xx: not UTF-8, though xgrammar counts one as a character),
still without escapes: a repetition of one character class keeps xgrammar's precomputed
masks, where one of "a character or an escape" costs each mask about a millisecond. Every
other string loses the surrogates too. Whitespace between tokens is at most
``JsonOptions.max_whitespace`` characters, or none at all (compact JSON).
"""

from __future__ import annotations

from dataclasses import dataclass

# Character classes as xgrammar 0.2.9 prints them (tests/unit/test_json_grammar.py feeds the
# compiled grammars bytes, so a version that prints them otherwise fails there, not in use):
# a bounded string's character, and every other string's.
_BOUNDED_CHAR = r"[^\"\\\r\n]"
_STRING_CHAR = r"[^\0-\x1f\"\\\r\n]"
# What both become: any character but a control character, quote, backslash or surrogate.
_JSON_CHAR = r"[^\0-\x1f\"\\\uD800-\uDFFF]"


@dataclass(frozen=True, slots=True)
class JsonOptions:
    """The server's JSON whitespace: at most ``max_whitespace`` characters between two
    tokens (0: no bound); ``any_whitespace`` False makes every JSON answer compact, as a
    request's ``disable_any_whitespace`` does (``--constrained-json-disable-any-whitespace``)."""

    max_whitespace: int = 0
    any_whitespace: bool = True


def json_schema_ebnf(schema: str, any_whitespace: bool, options: JsonOptions) -> str:
    """The EBNF of the JSON that ``schema`` (JSON text) accepts: every string strict JSON,
    whitespace as ``any_whitespace`` and ``options`` say. Objects take no property the schema
    does not list (xgrammar's strict mode). Raises the engine's error for an invalid schema."""
    import xgrammar as xgr

    free = any_whitespace and options.any_whitespace
    grammar = xgr.Grammar.from_json_schema(
        schema,
        any_whitespace=free,
        max_whitespace_cnt=options.max_whitespace if free and options.max_whitespace else None,
        strict_mode=True,
    )
    return strict_strings(str(grammar))


def strict_strings(ebnf: str) -> str:
    """``ebnf`` (xgrammar's printed conversion) with its string characters made strict (the
    module docstring)."""
    return ebnf.replace(_BOUNDED_CHAR, _JSON_CHAR).replace(_STRING_CHAR, _JSON_CHAR)
