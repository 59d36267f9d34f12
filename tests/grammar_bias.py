"""A ``logit_bias`` that keeps a random model's constrained answers short and well formed,
for the tests that run structured outputs and tool calls on the built-in model.

A JSON grammar allows any amount of whitespace between tokens, and a random model would spend
its budget there; two quirks of xgrammar 0.2.9 (docs/api.md, "Structured outputs") are biased
away too: tokens holding a control character (a bounded string lets a raw one in) and tokens
holding the byte 0xED (a UTF-8-encoded surrogate counted as one character). A bias cannot
bring back a token the grammar forbids: the mask comes first.
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


def _unwanted(token_id: int) -> bool:
    """Whitespace only, a control character, or the byte 0xED (see the docstring)."""
    text = TOKENIZER.tokenizer.decode([token_id])
    raw = bytes(BYTE_OF[c] for c in TOKENIZER.tokenizer.id_to_token(token_id))
    return bool(text) and (not text.strip() or any(ord(c) < 0x20 for c in text) or 0xED in raw)


UNWANTED_TOKENS = [
    i for i in range(TOKENIZER.vocab_size) if i not in TOKENIZER.special_token_ids and _unwanted(i)
]
STEADY = {
    str(i): -100 for i in UNWANTED_TOKENS
}  # logit_bias: keeps every answer short and well formed
