"""Incremental detokenization (docs/design.md section 5) with the shipped tokenizer."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from detokenizer_proc.incremental import IncrementalDetokenizer
from pipeline.io_struct import DecodeOptions, FinishLength, FinishStop
from pipeline.finish_reasons import DETOKENIZER_LOST_TEXT
from pipeline.tokenizer_loader import load_tokenizer

TOK = load_tokenizer(None)
SPECIAL = sorted(TOK.special_token_ids)
# Tokens of one byte each (the byte-level alphabet): the ones that leave UTF-8 runs open.
ONE_BYTE = [
    i
    for i in range(TOK.vocab_size)
    if i not in TOK.special_token_ids and len(TOK.tokenizer.id_to_token(i) or "") == 1
]
TEXTS = [
    "Hello, world! Plain ASCII to start.",
    "Accents: café, naïve, Ångström; CJK: 你好世界; emoji: 🎉🚀 and 𝄞 (four bytes).",
    "Mixed\nlines\twith  spaces and numbers 12345.",
]


def token_id(token: str) -> int:
    found = TOK.tokenizer.token_to_id(token)
    assert found is not None, token
    return found


def feed(
    detok: IncrementalDetokenizer,
    req_id: int,
    ids: list[int],
    sizes: list[int],
    options: DecodeOptions,
    final,
) -> list[str]:  # type: ignore[no-untyped-def]
    deltas, pos, first = [], 0, True
    for k, size in enumerate(sizes):
        chunk = ids[pos : pos + size]
        pos += size
        last = k == len(sizes) - 1
        deltas += detok.process(
            [req_id], [chunk], [final if last else None], [options if first else None]
        ).deltas
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
        deltas = feed(
            detok,
            i,
            ids,
            random_sizes(len(ids), rng),
            DecodeOptions(),
            FinishLength(length=len(ids)),
        )
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)
    assert detok.num_live == 0


def test_multibyte_char_split_over_byte_tokens_is_held_until_complete() -> None:
    ids = TOK.encode("𝄞")
    assert len(ids) > 1, "a rare 4-byte char should need several byte tokens"
    detok = IncrementalDetokenizer(TOK.tokenizer)
    deltas = feed(detok, 1, ids, [1] * len(ids), DecodeOptions(), FinishLength(length=len(ids)))
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "𝄞"


def test_incomplete_sequence_at_the_end_is_held_then_shown_as_the_decode_shows_it() -> None:
    """While streaming, the open run is held (no U+FFFD that later bytes might have
    completed); at the finish nothing can complete it, so the text ends as the tokenizer's
    own decode of the ids ends: here, in one U+FFFD."""
    ids = TOK.encode("ok 𝄞")[:-1]
    detok = IncrementalDetokenizer(TOK.tokenizer)
    deltas = feed(detok, 1, ids, [1] * len(ids), DecodeOptions(), FinishLength(length=len(ids)))
    assert "".join(deltas[:-1]) == "ok " and deltas[-1] == "\ufffd"
    assert "".join(deltas) == TOK.decode(ids) == _one_row(ids, FinishLength(length=len(ids)))
    assert detok.num_live == 0


def test_skip_special_tokens_is_honoured() -> None:
    ids = TOK.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] in TOK.special_token_ids
    detok = IncrementalDetokenizer(TOK.tokenizer)
    skipped = feed(
        detok,
        1,
        ids,
        [1] * len(ids),
        DecodeOptions(skip_special_tokens=True),
        FinishLength(length=1),
    )
    kept = feed(
        detok,
        2,
        ids,
        [1] * len(ids),
        DecodeOptions(skip_special_tokens=False),
        FinishLength(length=1),
    )
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
    kept = feed(
        detok,
        2,
        ids[:upto],
        [1] * upto,
        DecodeOptions(stop=("STOP",), no_stop_trim=True),
        FinishStop(matched="STOP"),
    )
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
        for i, delta in zip(rows, out.deltas):
            joined[i] += delta
    assert joined == TEXTS and detok.num_live == 0


def test_a_row_whose_first_row_never_came_fails_its_request_and_keeps_no_state() -> None:
    """Every request's first row carries its decode options, so a row with neither state nor
    options belongs to a request whose earlier rows this detokenizer never saw (it
    restarted): its text is lost, and the row finishes the request with a 503 instead of
    passing on as output; the other rows of the frame are untouched."""
    detok = IncrementalDetokenizer(TOK.tokenizer)
    known = TOK.encode("hi")
    out = detok.process([5, 6], [[42], known], None, [None, DecodeOptions()])
    assert out.deltas == ["", "hi"] and out.finished == [DETOKENIZER_LOST_TEXT, None]
    assert detok.num_live == 1
    # Later rows of the lost request fail the same way, and no state is kept for it.
    out = detok.process([5, 6], [[43, 44], []], [None, FinishLength(length=len(known))], None)
    assert out.deltas == ["", ""] and out.finished == [
        DETOKENIZER_LOST_TEXT,
        FinishLength(length=len(known)),
    ]
    assert detok.num_live == 0
    # A frame of known rows only keeps its finish column as it came (None: none finishes).
    first = detok.process([7], [known], None, [DecodeOptions()])
    assert first.finished is None and first.deltas == ["hi"]


def _one_row(  # type: ignore[no-untyped-def]
    ids: list[int], reason, options: DecodeOptions = DecodeOptions(stream=False)
) -> str:
    return IncrementalDetokenizer(TOK.tokenizer).process([1], [ids], [reason], [options]).deltas[0]


def _streamed(  # type: ignore[no-untyped-def]
    ids: list[int], reason, options: DecodeOptions = DecodeOptions()
) -> list[str]:
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
    assert (
        _one_row(eos, FinishStop(matched=0), DecodeOptions(stream=False, skip_special_tokens=False))
        == " done"
    )


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
    shows them as they come (U+FFFD each) instead of holding all to the end; at the end
    the text is the decode's, the same streamed or not."""
    ff = token_id("ÿ")  # byte 0xFF in the byte-level alphabet
    ids = [ff] * 50
    deltas = _streamed(ids, FinishLength(length=50))
    assert sum(1 for d in deltas if d) >= 45
    assert (
        "".join(deltas)
        == "\ufffd" * 50
        == TOK.decode(ids)
        == _one_row(ids, FinishLength(length=50))
    )


def test_skipped_special_tokens_between_the_bytes_of_a_character_do_not_break_it() -> None:
    """The first two bytes of 𝄞, three special tokens that skip_special_tokens leaves out,
    then its last two bytes: the decode of the ids is 𝄞, so the stream must hold the open
    run across the tokens that add no bytes rather than release it as U+FFFD."""
    ids = TOK.encode("𝄞")
    assert len(ids) == 4, "𝄞 should be four byte tokens"
    with_specials = [*ids[:2], *SPECIAL[1:4], *ids[2:]]
    skip = DecodeOptions(skip_special_tokens=True)
    assert TOK.decode(with_specials) == "𝄞"
    deltas = _streamed(with_specials, FinishLength(length=len(with_specials)), skip)
    assert deltas == [""] * (len(with_specials) - 1) + ["𝄞"]
    # Kept as text, a special token closes the run before it, as the decode shows.
    keep = DecodeOptions(skip_special_tokens=False)
    kept = "".join(_streamed(with_specials, FinishLength(length=len(with_specials)), keep))
    assert kept == TOK.tokenizer.decode(with_specials, skip_special_tokens=False)


def test_a_run_is_released_once_three_bytes_follow_it_however_few_tokens_carry_them() -> None:
    """0xFF, then two tokens of two bytes each (a continuation byte and a lead byte): three
    bytes after the 0xFF settle it, so its U+FFFD goes out now, not a token later."""
    ff = token_id("ÿ")
    two = token_id("Ħå")  # bytes 0x84 0xE5: ends in an open lead byte
    assert TOK.tokenizer.decode([ff, two, two]).endswith("\ufffd")
    detok = IncrementalDetokenizer(TOK.tokenizer)
    sent = detok.process([1], [[ff]], None, [DecodeOptions()]).deltas
    sent += detok.process([1], [[two]], None, None).deltas
    sent += detok.process([1], [[two]], None, None).deltas
    assert "".join(sent).startswith("\ufffd")
    assert "".join(sent) + detok.process([1], [[]], [FinishLength(length=3)], None).deltas[
        0
    ] == TOK.decode([ff, two, two])


_IDS = st.lists(
    st.one_of(
        st.sampled_from(ONE_BYTE), st.sampled_from(SPECIAL), st.integers(0, TOK.vocab_size - 1)
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(
    ids=_IDS,
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=8),
    skip=st.booleans(),
    stream=st.booleans(),
    stop=st.sampled_from([(), ("zz",), ("\ufffd\ufffd",)]),
)
def test_finished_text_is_the_decode_of_its_ids(
    ids: list[int], sizes: list[int], skip: bool, stream: bool, stop: tuple[str, ...]
) -> None:
    """Whatever the ids (open and invalid UTF-8 runs, special tokens anywhere) and however
    they are cut into rows, the deltas joined at the finish are the tokenizer's decode of
    the ids with the request's skip_special_tokens (no stop trimmed: a length finish), and
    so is the non-streamed text."""
    chunks, pos, k = [], 0, 0
    while pos < len(ids):
        chunks.append(sizes[k % len(sizes)])
        pos += chunks[-1]
        k += 1
    chunks[-1] -= pos - len(ids)
    options = DecodeOptions(skip_special_tokens=skip, stream=stream, stop=stop)
    expected = TOK.tokenizer.decode(ids, skip_special_tokens=skip)
    detok = IncrementalDetokenizer(TOK.tokenizer)
    assert "".join(feed(detok, 1, ids, chunks, options, FinishLength(length=len(ids)))) == expected
    assert _one_row(ids, FinishLength(length=len(ids)), options) == expected
    assert detok.num_live == 0
