"""A ``logit_bias`` that keeps a random model's constrained answers short, for the tests that
run structured outputs and tool calls on the built-in model.

A JSON grammar allows whitespace between tokens (up to --constrained-json-max-whitespace
characters a gap, 24 by default), and a random model, for which a blank is as likely as
anything else, would fill every gap: answers run several times longer and may not end
within a test's ``max_tokens``. ``STEADY`` biases whitespace-only tokens away. A bias cannot
bring back a token the grammar forbids: the mask comes first.

Nothing else needs hiding: strings take no raw control character and no encoded surrogate
(docs/api.md, "Structured outputs"). ``STRAY_TOKENS`` names the tokens that hold one, for
the tests that push them to show it.
"""

from __future__ import annotations

from pipeline.tokenizer_loader import load_tokenizer

TOKENIZER = load_tokenizer(None)


def _byte_level_table() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): the character each byte is written as."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


BYTE_OF = _byte_level_table()


def raw_bytes(token_id: int) -> bytes:
    return bytes(BYTE_OF[c] for c in TOKENIZER.tokenizer.id_to_token(token_id))


def _text(token_id: int) -> str:
    return TOKENIZER.tokenizer.decode([token_id])


_ORDINARY = [i for i in range(TOKENIZER.vocab_size) if i not in TOKENIZER.special_token_ids]
# JSON's whitespace (RFC 8259): space, tab, line feed, carriage return; no other.
WHITESPACE_TOKENS = [i for i in _ORDINARY if _text(i) and not _text(i).strip(" \t\n\r")]
# Tokens holding another control character, or the byte 0xED (the lead byte of an encoded
# surrogate, and of some Hangul): what a strict JSON string never holds raw, or holds only
# as a whole character.
STRAY_TOKENS = [
    i
    for i in _ORDINARY
    if i not in WHITESPACE_TOKENS and (any(ord(c) < 0x20 for c in _text(i)) or 0xED in raw_bytes(i))
]
STEADY = {str(i): -100 for i in WHITESPACE_TOKENS}  # logit_bias: keeps every answer short
