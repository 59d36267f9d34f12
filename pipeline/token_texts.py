"""Single-token texts for logprob entries (docs/design/logprobs.md): what
``return_text_in_logprobs`` and OpenAI's ``token``/``tokens`` fields show for a token id, its
own decoding with special tokens shown.

The detokenizer makes them for a whole frame at once (one ``decode_batch`` over the ids it
has not decoded before) and sends them with the frame (``BatchStrOutput.token_texts``); the
tokenizer manager keeps what arrives, so building an answer is dict lookups. Both keep
them in a ``TokenTextCache``, which the vocabulary bounds: a token's text never changes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Protocol

import numpy as np
from tokenizers import Tokenizer, decoders

from pipeline.io_struct import TokenTexts


class TokenText(Protocol):
    """A token's text, and its raw bytes (OpenAI's ``bytes``: a token that holds part of a
    UTF-8 character has bytes that its text, U+FFFD, does not show)."""

    def __call__(self, token: int) -> str: ...

    def raw(self, token: int) -> bytes: ...


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's vocabulary spells byte b as one printable character: b itself for
    the printable ranges, 256 + n for the n-th other byte (GPT-2's bytes_to_unicode)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    chars.update({chr(256 + n): b for n, b in enumerate(others)})
    return chars


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenTextCache:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._raw: dict[int, bytes] = {}
        self._alphabet = (
            _byte_level_alphabet() if isinstance(tokenizer.decoder, decoders.ByteLevel) else None
        )

    def raw(self, token: int) -> bytes:
        """The token's bytes from its vocabulary entry: byte-level BPE spells them out, a
        byte-fallback token is ``<0xNN>``; any other token's bytes are its text's."""
        raw = self._raw.get(token)
        if raw is None:
            piece = self._tokenizer.id_to_token(token) or ""
            fallback = _BYTE_FALLBACK.fullmatch(piece)
            alphabet = self._alphabet
            if fallback is not None:
                raw = bytes([int(fallback.group(1), 16)])
            elif alphabet is not None and piece and all(c in alphabet for c in piece):
                raw = bytes(alphabet[c] for c in piece)
            else:
                raw = self(token).encode("utf-8")
            self._raw[token] = raw
        return raw

    def __call__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            self.fill((token,))
            text = self._texts[token]
        return text

    def fill(self, ids: Iterable[int]) -> None:
        """Decodes the ids not known yet, all in one batch."""
        known = self._texts
        missing = list({t for t in ids if t not in known})
        if missing:
            texts = self._tokenizer.decode_batch([[t] for t in missing], skip_special_tokens=False)
            known.update(zip(missing, texts))

    def frame_texts(self, ids: np.ndarray) -> TokenTexts | None:
        """The texts of ``ids`` (any order, repeats allowed), each id once, for a frame."""
        if not len(ids):
            return None
        unique = np.unique(ids).astype(np.int32)
        listed = unique.tolist()
        self.fill(listed)
        known = self._texts
        return TokenTexts(ids=unique.tobytes(), texts=[known[t] for t in listed])

    def add(self, texts: TokenTexts) -> None:
        """Keeps a frame's texts. Raises ValueError when its columns disagree."""
        ids = np.frombuffer(texts.ids, dtype=np.int32)
        if len(ids) != len(texts.texts):
            raise ValueError(f"token_texts has {len(ids)} ids and {len(texts.texts)} texts")
        self._texts.update(zip(ids.tolist(), texts.texts))
