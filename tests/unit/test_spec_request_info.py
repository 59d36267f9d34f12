"""Speculative decoding per request: SGLang's ``spec_*`` keys in ``meta_info``
(tokenizer_proc/request_edge/meta_info.py) and the ``tokenpipe.spec_*`` span attributes
(tokenizer_proc/tracing.py), from the counts the scheduler puts in the request's stats; both
left out for a request that had no drafts verified."""

from __future__ import annotations

import pytest
from msgspec.structs import replace

from pipeline.io_struct import FinishLength
from tests.unit.test_metrics_compat import finished
from tokenizer_proc.req_state import ReqState, StreamChunk
from tokenizer_proc.request_edge.meta_info import build_meta_info
from tokenizer_proc.tracing import span_attributes

SPEC_KEYS = {
    "spec_verify_ct",
    "spec_accept_length",
    "spec_accept_rate",
    "spec_accept_token_num",
    "spec_draft_token_num",
}


def speculated(verify_ct: int, drafted: int, accepted: int, out: int = 20) -> ReqState:
    state = finished(1, stream=False, reason=FinishLength(length=out), out=out)
    assert state.request_stats is not None
    state.request_stats = replace(
        state.request_stats,
        spec_verify_ct=verify_ct,
        spec_draft_tokens=drafted,
        spec_accepted_tokens=accepted,
    )
    return state


def test_meta_info_carries_sglangs_keys() -> None:
    # 5 verify passes with drafts: 16 drafts, 9 accepted, so 14 tokens from those passes
    # (the other 6 from steps that drafted nothing).
    meta = build_meta_info(speculated(verify_ct=5, drafted=16, accepted=9))
    assert meta["spec_verify_ct"] == 5
    assert meta["spec_accept_token_num"] == 9
    assert meta["spec_draft_token_num"] == 16
    assert meta["spec_accept_rate"] == pytest.approx(9 / 16)
    assert meta["spec_accept_length"] == pytest.approx((9 + 5) / 5)  # tokens per verify pass


def test_meta_info_leaves_them_out_without_verified_drafts() -> None:
    assert not SPEC_KEYS & set(build_meta_info(speculated(verify_ct=0, drafted=0, accepted=0)))
    # Drafts verified but none accepted: every key, the rate 0 and a length of 1.
    meta = build_meta_info(speculated(verify_ct=3, drafted=6, accepted=0))
    assert (meta["spec_accept_rate"], meta["spec_accept_length"]) == (0.0, 1.0)


def test_an_interim_stream_event_carries_its_own_stats() -> None:
    state = speculated(verify_ct=5, drafted=16, accepted=9)
    assert state.request_stats is not None
    # Before the request left the running batch its stats carried no speculative counts.
    early = StreamChunk(
        text="",
        ids=[],
        completion_tokens=4,
        stats=replace(state.request_stats, spec_verify_ct=0, spec_draft_tokens=0),
    )
    assert not SPEC_KEYS & set(build_meta_info(state, early))


def test_span_attributes_carry_the_counts() -> None:
    attrs = span_attributes(speculated(verify_ct=5, drafted=16, accepted=9), "m")
    assert attrs["tokenpipe.spec_verify_ct"] == 5
    assert attrs["tokenpipe.spec_draft_tokens"] == 16
    assert attrs["tokenpipe.spec_accepted_tokens"] == 9
    plain = span_attributes(speculated(verify_ct=0, drafted=0, accepted=0), "m")
    assert not {key for key in plain if key.startswith("tokenpipe.spec_")}
