"""Logprob token texts are made in the detokenizer, a frame at a time: frames from the real
scheduler go through the real detokenizer, whose ``token_texts`` hold exactly the ids of
the logprob entries of the rows whose requests show texts (chosen and top ids, output and
prompt), each once, decoded on its own; a frame with no such row carries none. The
tokenizer manager then answers from what the frames brought, without decoding."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from detokenizer_proc.incremental import IncrementalDetokenizer
from detokenizer_proc.main import detokenize_frame
from pipeline.io_struct import (
    REQ_ID_DTYPE,
    BatchTokenIDOutput,
    LogprobParams,
    SamplingParams,
    TokenTexts,
)
from pipeline.columns import from_column, split_token_rows
from pipeline.logprob_columns import read_input_logprobs, read_output_logprobs
from pipeline.token_texts import TokenTextCache
from pipeline.tokenizer_loader import load_tokenizer
from tests.unit.test_output_logprobs import make, submit

SHOWN = LogprobParams(top_logprobs_num=3, logprob_start_len=2, return_text=True)
HIDDEN = LogprobParams(top_logprobs_num=2)


def expected_ids(frame: BatchTokenIDOutput, shown: set[int]) -> set[int]:
    req_ids = from_column(frame.req_ids, REQ_ID_DTYPE).tolist()
    rows = split_token_rows(frame.output_ids, frame.output_counts)
    ids: set[int] = set()
    lp = frame.logprobs
    if lp is None:
        return ids
    if lp.output is not None:
        for i, row in read_output_logprobs(lp.output, [len(r) for r in rows]).items():
            if req_ids[i] in shown:
                ids.update(rows[i])
                ids.update(t for top in row.top for _, t in top)
    if lp.input is not None:
        for i, row in read_input_logprobs(lp.input, len(rows)).items():
            if req_ids[i] in shown:
                ids.update(t for top in row.top for _, t in top)
    return ids


def test_the_detokenizer_sends_the_texts_of_the_rows_that_show_them() -> None:
    loaded = load_tokenizer(None)
    detok = IncrementalDetokenizer(loaded.tokenizer)
    texts = TokenTextCache(loaded.tokenizer)
    s = make()
    submit(s, 0, SamplingParams(temperature=0.0), SHOWN)
    submit(s, 1, SamplingParams(temperature=0.8, seed=2), HIDDEN, interval=2)
    submit(s, 2, SamplingParams(temperature=0.0), None)
    submit(s, 3, SamplingParams(temperature=1.0, seed=5), SHOWN, stream=False)
    with_texts = 0
    while s.has_work():
        for frame in s.step():
            assert isinstance(frame, BatchTokenIDOutput)
            frame = msgspec.msgpack.decode(msgspec.msgpack.encode(frame), type=BatchTokenIDOutput)
            out = detokenize_frame(detok, frame, texts)
            want = expected_ids(frame, {0, 3})
            if not want:
                assert out.token_texts is None
                continue
            with_texts += 1
            assert out.token_texts is not None
            ids = np.frombuffer(out.token_texts.ids, dtype=np.int32).tolist()
            assert ids == sorted(want), (
                "each shown id once, and no id of a row that does not show texts"
            )
            assert out.token_texts.texts == [
                loaded.tokenizer.decode([t], skip_special_tokens=False) for t in ids
            ]
    assert with_texts > 0


def test_a_cache_answers_from_frames_and_refuses_a_disagreeing_one() -> None:
    loaded = load_tokenizer(None)
    cache = TokenTextCache(loaded.tokenizer)
    cache.add(TokenTexts(ids=np.array([7, 9], dtype=np.int32).tobytes(), texts=["seven", "nine"]))
    assert cache(7) == "seven" and cache(9) == "nine"  # what the frame said, no decode
    assert cache(11) == loaded.tokenizer.decode(
        [11], skip_special_tokens=False
    )  # a miss is decoded
    with pytest.raises(ValueError):
        cache.add(TokenTexts(ids=np.array([1, 2], dtype=np.int32).tobytes(), texts=["one"]))


def test_raw_bytes_spell_out_the_tokens_that_split_a_character() -> None:
    """OpenAI's ``bytes``: joined, the tokens' bytes are the text, also where a character is
    split over tokens whose own texts are U+FFFD."""
    loaded = load_tokenizer(None)
    cache = TokenTextCache(loaded.tokenizer)
    ids = loaded.tokenizer.encode("naïve café ☕ 日本語", add_special_tokens=False).ids
    assert any("\ufffd" in cache(t) for t in ids), "no token splits a character: pick another text"
    assert b"".join(cache.raw(t) for t in ids).decode("utf-8") == "naïve café ☕ 日本語"
    assert all(
        cache.raw(t).decode("utf-8", errors="replace") == cache(t) for t in range(loaded.vocab_size)
    )
