"""Incremental detokenization (docs/design.md section 5) with the shipped tokenizer."""

from __future__ import annotations

import random

from detokenizer_proc.incremental import IncrementalDetokenizer
from pipeline.io_struct import DecodeOptions, FinishLength, FinishStop
from pipeline.tokenizer_loader import load_tokenizer

TOK = load_tokenizer(None)
TEXTS = [
    "Hello, world! Plain ASCII to start.",
    "Accents: café, naïve, Ångström; CJK: 你好世界; emoji: 🎉🚀 and 𝄞 (four bytes).",
    "Mixed\nlines\twith  spaces and numbers 12345.",
]


def feed(detok: IncrementalDetokenizer, req_id: int, ids: list[int], sizes: list[int], options: DecodeOptions, final) -> list[str]:  # type: ignore[no-untyped-def]
    deltas, pos, first = [], 0, True
    for k, size in enumerate(sizes):
        chunk = ids[pos : pos + size]
        pos += size
        last = k == len(sizes) - 1
        deltas += detok.process([req_id], [chunk], [final if last else None], [options if first else None])
        first = False
    return deltas


def random_sizes(n: int, rng: random.Random) -> list[int]:
    sizes = []
    while n > 0:
        sizes.append(min(n, rng.randint(1, 3)))
        n -= sizes[-1]
    return sizes


def test_deltas_join_to_the_full_decode_without_replacement_chars() -> None:
    rng = random.Random(0)
    detok = IncrementalDetokenizer(TOK.tokenizer)
    for i, text in enumerate(TEXTS * 5):
        ids = TOK.encode(text)
        deltas = feed(detok, i, ids, random_sizes(len(ids), rng), DecodeOptions(), FinishLength(length=len(ids)))
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)
    assert detok.num_live == 0


def test_multibyte_char_split_over_byte_tokens_is_held_until_complete() -> None:
    ids = TOK.encode("𝄞")
    assert len(ids) > 1, "a rare 4-byte char should need several byte tokens"
    detok = IncrementalDetokenizer(TOK.tokenizer)
    deltas = feed(detok, 1, ids, [1] * len(ids), DecodeOptions(), FinishLength(length=len(ids)))
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "𝄞"


def test_incomplete_sequence_at_the_end_is_dropped() -> None:
    ids = TOK.encode("ok 𝄞")[:-1]
    detok = IncrementalDetokenizer(TOK.tokenizer)
    deltas = feed(detok, 1, ids, [1] * len(ids), DecodeOptions(), FinishLength(length=len(ids)))
    assert "".join(deltas) == "ok " and detok.num_live == 0


def test_skip_special_tokens_is_honoured() -> None:
    ids = TOK.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] in TOK.special_token_ids
    detok = IncrementalDetokenizer(TOK.tokenizer)
    skipped = feed(detok, 1, ids, [1] * len(ids), DecodeOptions(skip_special_tokens=True), FinishLength(length=1))
    kept = feed(detok, 2, ids, [1] * len(ids), DecodeOptions(skip_special_tokens=False), FinishLength(length=1))
    assert "".join(skipped) == "user\nhi"
    assert "".join(kept) == "<|im_start|>user\nhi<|im_end|>"


def test_stop_string_trimmed_and_never_streamed() -> None:
    text = "The answer is 42. STOP and more"
    ids = TOK.encode(text)
    # The finish row is the one whose text completes "STOP".
    upto = next(n for n in range(1, len(ids) + 1) if "STOP" in TOK.decode(ids[:n]))
    detok = IncrementalDetokenizer(TOK.tokenizer)
    options = DecodeOptions(stop=("STOP",), stream=True)
    deltas = feed(detok, 1, ids[:upto], [1] * upto, options, FinishStop(matched="STOP"))
    assert "".join(deltas) == "The answer is 42. "
    assert all("S" not in d for d in deltas), "a held-back prefix of the stop string leaked"
    kept = feed(detok, 2, ids[:upto], [1] * upto, DecodeOptions(stop=("STOP",), no_stop_trim=True), FinishStop(matched="STOP"))
    assert "".join(kept).endswith("STOP")


def test_rows_of_many_requests_in_one_frame() -> None:
    detok = IncrementalDetokenizer(TOK.tokenizer)
    encoded = [TOK.encode(t) for t in TEXTS]
    joined = ["", "", ""]
    for step in range(max(map(len, encoded))):
        rows = [i for i, ids in enumerate(encoded) if step < len(ids)]
        out = detok.process(
            rows,
            [[encoded[i][step]] for i in rows],
            [FinishLength(length=1) if step == len(encoded[i]) - 1 else None for i in rows],
            [DecodeOptions() if step == 0 else None for i in rows],
        )
        for i, delta in zip(rows, out):
            joined[i] += delta
    assert joined == TEXTS and detok.num_live == 0


def test_row_of_an_unknown_request_keeps_no_state() -> None:
    detok = IncrementalDetokenizer(TOK.tokenizer)
    known = TOK.encode("hi")
    out = detok.process([5, 6], [[42], known], [None, None], [None, DecodeOptions()])
    assert out[0] == "" and detok.num_live == 1
    out = detok.process([6], [[]], [FinishLength(length=len(known))], None)
    assert detok.num_live == 0


def _one_row(ids: list[int], reason, options: DecodeOptions = DecodeOptions(stream=False)) -> str:  # type: ignore[no-untyped-def]
    return IncrementalDetokenizer(TOK.tokenizer).process([1], [ids], [reason], [options])[0]


def _streamed(ids: list[int], reason, options: DecodeOptions = DecodeOptions()) -> list[str]:  # type: ignore[no-untyped-def]
    return feed(IncrementalDetokenizer(TOK.tokenizer), 1, ids, [1] * len(ids), options, reason)


def test_a_stop_token_text_is_trimmed_unless_asked_to_keep_it() -> None:
    """stop_token_ids [id of " follows"]: its text is not output, streamed or not."""
    ids = TOK.encode(" onglessongless follows")
    stop = FinishStop(matched=ids[-1])
    assert _one_row(ids, stop) == TOK.decode(ids[:-1])
    assert "".join(_streamed(ids, stop)) == TOK.decode(ids[:-1])
    assert _one_row(ids, stop, DecodeOptions(stream=False, no_stop_trim=True)) == TOK.decode(ids)
    # EOS kept as text (skip_special_tokens false) is a stop token too.
    eos = [*TOK.encode(" done"), 0]
    assert _one_row(eos, FinishStop(matched=0), DecodeOptions(stream=False, skip_special_tokens=False)) == " done"


def test_a_stop_string_is_cut_at_the_occurrence_that_ended_the_request() -> None:
    """min_new_tokens let the first " 15" through; the request ended on the second, and
    the text is cut there, streamed or not (once cut at the first: " ")."""
    ids = TOK.encode(" 15 wanting 15")
    stop = FinishStop(matched="15")
    options = ("15",)
    assert _one_row(ids, stop, DecodeOptions(stream=False, stop=options)) == " 15 wanting "
    assert "".join(_streamed(ids, stop, DecodeOptions(stop=options))) == " 15 wanting "


def test_of_two_stop_strings_the_text_holds_neither() -> None:
    ids = TOK.encode(" 15 wanting sources")
    stop = FinishStop(matched="sou")  # what the stop checker reports: the earliest start
    options = ("es", "sou")
    assert _one_row(ids, stop, DecodeOptions(stream=False, stop=options)) == " 15 wanting "
    assert "".join(_streamed(ids, stop, DecodeOptions(stop=options))) == " 15 wanting "


def test_a_byte_run_that_can_never_be_a_character_is_released_as_it_goes() -> None:
    """50 tokens of the byte 0xFF: no UTF-8 character can come of them, so the stream
    shows them as they come (U+FFFD each) instead of holding all to the end; what the
    last three tokens might still have completed is dropped at the end, the same streamed
    or not."""
    ff = TOK.tokenizer.token_to_id("ÿ")  # byte 0xFF in the byte-level alphabet
    ids = [ff] * 50
    deltas = _streamed(ids, FinishLength(length=50))
    assert sum(1 for d in deltas if d) >= 45
    assert "".join(deltas) == "\ufffd" * 47 == _one_row(ids, FinishLength(length=50))
