"""Single-token texts for logprob entries (SPEC section 11): what ``return_text_in_logprobs``
and OpenAI's ``token``/``tokens`` fields show for a token id, its own decoding with special
tokens shown.

The detokenizer makes them for a whole frame at once (one ``decode_batch`` over the ids it
has not decoded before) and sends them with the frame (``BatchStrOutput.token_texts``); the
tokenizer manager keeps what arrives, so building an answer is dict lookups. Both keep
them in a ``TokenTextCache``, which the vocabulary bounds: a token's text never changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
from tokenizers import Tokenizer

from pipeline.io_struct import TokenTexts

TokenText = Callable[[int], str]


class TokenTextCache:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

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
