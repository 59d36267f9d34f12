"""The stop checker against the shipped tokenizer: which stop string ends a request, and
when, with ``min_new_tokens`` and special tokens in play."""

from __future__ import annotations

import numpy as np

from pipeline.io_struct import FinishLength, FinishReason, FinishStop, SamplingParams
from pipeline.tokenizer_loader import load_tokenizer
from scheduler_proc.req import Req, StatsPending
from scheduler_proc.stop_checker import StopChecker

TOK = load_tokenizer(None)
CHECKER = StopChecker(TOK.eos_token_ids, TOK.decode, context_length=4096)


def run(ids: list[int], **params: object) -> tuple[int, FinishReason | None]:
    """Feeds ``ids`` one at a time as the scheduler does; returns how many were appended
    when the request finished, and why."""
    req = Req(
        rid="r",
        req_id=1,
        input_ids=[7],
        sampling=SamplingParams(**params),  # type: ignore[arg-type]
        stream=False,
        stream_interval=1,
        arrival_time=0.0,
        stats_pending=StatsPending(),
    )
    for token in ids:
        req.output_ids.append(token)
        reason = CHECKER.check(req)
        if reason is not None:
            return len(req.output_ids), reason
    return len(req.output_ids), None


def test_a_stop_string_seen_before_min_new_tokens_does_not_end_the_request_later() -> None:
    """ " 15" is met in the first tokens; with min_new_tokens 3 the request must go on until
    a new occurrence (here: none), not stop at token 3 on the old one."""
    ids = TOK.encode(" 15 wanting sources of water")
    n, reason = run(ids, stop=("15",), min_new_tokens=3, max_new_tokens=len(ids))
    assert (n, reason) == (len(ids), FinishLength(length=len(ids)))


def test_a_stop_string_met_again_after_min_new_tokens_stops_there() -> None:
    ids = TOK.encode(" 15 wanting 15 sources")
    n, reason = run(ids, stop=("15",), min_new_tokens=3, max_new_tokens=len(ids))
    assert reason == FinishStop(matched="15")
    assert TOK.decode(ids[:n]).endswith("15")


def test_of_several_stop_strings_met_in_one_token_the_earliest_wins() -> None:
    """ " sources" completes both "es" and "sou": "sou" starts first, whatever the order
    the strings were listed in."""
    ids = TOK.encode(" 15 wanting sources")
    for stops in (("es", "sou"), ("sou", "es")):
        n, reason = run(ids, stop=stops, max_new_tokens=10)
        assert (n, reason) == (len(ids), FinishStop(matched="sou")), stops


def test_a_stop_string_matches_a_special_token_when_special_tokens_are_kept() -> None:
    ids = TOK.encode(" hello") + [1] + TOK.encode(" world")  # 1 is <|im_start|>
    assert run(ids, stop=("<|im_start|>",), max_new_tokens=10, skip_special_tokens=False)[
        1
    ] == FinishStop(matched="<|im_start|>")
    # Skipped, the special token has no text to match.
    assert run(ids, stop=("<|im_start|>",), max_new_tokens=10)[1] is None


def test_a_stop_string_completed_by_the_last_byte_of_a_character_matches() -> None:
    ids = TOK.encode("ok 𝄞 done")
    n, reason = run(ids, stop=("𝄞",), max_new_tokens=20)
    assert reason == FinishStop(matched="𝄞")
    assert TOK.decode(ids[:n]).endswith("𝄞")


def test_a_stop_string_with_skipped_special_tokens_inside_matches() -> None:
    """Skipped special tokens have no text: ``[a, <sp>, <sp>, b]`` reads "ab", so the stop
    "ab" ends there however many special tokens sit inside it (the window the checker
    decodes counts bytes of text, not tokens)."""
    a, b = TOK.encode("a") + TOK.encode("b")
    for specials in ([1], [1, 2], [1, 2, 3, 4, 5, 1, 2]):
        ids = TOK.encode(" x") + [a, *specials, b] + TOK.encode(" y")
        n, reason = run(ids, stop=("ab",), max_new_tokens=len(ids))
        assert (n, reason) == (len(ids) - 1, FinishStop(matched="ab")), specials
    # A longer stop across several tokens, a special token between each two.
    words = TOK.encode(" hello world")
    ids = [t for token in words for t in (token, 2, 1)]
    n, reason = run(ids, stop=("hello world",), max_new_tokens=len(ids))
    assert (n, reason) == (len(ids) - 2, FinishStop(matched="hello world"))
    # Kept, the special tokens' text sits inside: no match.
    ids = [a, 1, 1, b]
    assert run(ids, stop=("ab",), max_new_tokens=10, skip_special_tokens=False)[1] is None


def test_min_new_bans_name_the_stop_ids_and_eos_of_short_rows_only() -> None:
    """The decode step's column form and the per-request form agree: a row short of
    min_new_tokens bans its stop ids and EOS (with ignore_eos too), the others nothing."""
    params = [
        SamplingParams(min_new_tokens=3, stop_token_ids=(70, 71)),
        SamplingParams(min_new_tokens=3, stop_token_ids=(70,), ignore_eos=True),
        SamplingParams(min_new_tokens=0, stop_token_ids=(9,)),
        SamplingParams(min_new_tokens=2),
    ]
    out_lens = [2, 0, 0, 2]
    table = np.full((4, 2), -1, dtype=np.int64)
    for i, p in enumerate(params):
        table[i, : len(p.stop_token_ids)] = p.stop_token_ids
    eos = sorted(TOK.eos_token_ids)
    want = {(0, 70), (0, 71), (1, 70)} | {(row, e) for row in (0, 1) for e in eos}
    for bans in (
        CHECKER.min_new_bans(
            np.array(out_lens), np.array([p.min_new_tokens for p in params]), table
        ),
        CHECKER.min_new_bans_of(params, out_lens),
    ):
        assert bans is not None
        assert set(zip(bans.rows.tolist(), bans.ids.tolist())) == want
    assert CHECKER.min_new_bans(np.array([3, 5]), np.array([3, 0]), table[:2]) is None
    assert CHECKER.min_new_bans_of(params[2:], [0, 2]) is None
