"""``--dense-usage-columns`` (docs/wire.md section 6): every ``BatchTokenIDOutput`` row also
carries prompt, cached and media token counts as int32 columns, for a consumer that keeps no
per-request state.

The end-to-end test plays that consumer: it binds the detokenizer's endpoint itself, runs
``tokenpipe scheduler`` alone, and decodes every frame with an untyped msgpack decode that
follows docs/wire.md. It never uses tokenpipe's types to read a frame.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from pipeline.config import ServerConfig
from pipeline.server_args import add_server_args, config_from_args
from pipeline.io_struct import (
    BatchTokenIDOutput,
    CachedTokensDetails,
    FinishStop,
    MediaItem,
    SamplingParams,
    TokenizedGenerateReqInput,
)
from pipeline.tokenizer_loader import load_tokenizer
from scheduler_proc.output_builder import build_token_output
from scheduler_proc.req import Req, StatsPending
from tests.server_harness import REPO, free_port, role_process

# --- the consumer's side: docs/wire.md, by hand ----------------------------------------

# BatchTokenIDOutput: element 0 is the tag, then these fields in order (docs/wire.md section 4).
TOK_FIELDS = (
    "req_ids",
    "output_ids",
    "output_counts",
    "completion_tokens",
    "finished_reasons",
    "request_stats",
    "decode_options",
    "usage",
)
TOK_DEFAULTS: dict[str, Any] = {
    "finished_reasons": None,
    "request_stats": None,
    "decode_options": None,
    "usage": None,
}
STATS_FIELDS = (
    "prompt_tokens",
    "cached_tokens",
    "cached_tokens_details",
    "num_retractions",
    "image_tokens",
    "audio_tokens",
    "video_tokens",
    "time_stats",
)
STATS_DEFAULTS: dict[str, Any] = {
    "prompt_tokens": 0,
    "cached_tokens": 0,
    "cached_tokens_details": None,
    "num_retractions": 0,
    "image_tokens": 0,
    "audio_tokens": 0,
    "video_tokens": 0,
    "time_stats": None,
}
USAGE_FIELDS = ("prompt_tokens", "cached_tokens", "image_tokens", "audio_tokens", "video_tokens")


def fields_of(array: list[Any], names: tuple[str, ...], defaults: dict[str, Any]) -> dict[str, Any]:
    """An array-encoded struct as a dict: a shorter array takes the defaults of its missing
    trailing fields, and extra trailing elements are ignored (docs/wire.md section 3)."""
    out = dict(defaults)
    out.update(zip(names, array))
    missing = [name for name in names if name not in out]
    assert not missing, f"required fields missing: {missing}"
    return out


def decode_token_frame(frame: bytes) -> dict[str, Any] | None:
    """A token frame as plain Python values, or None for a frame to skip."""
    value = msgspec.msgpack.decode(frame)  # untyped: lists, bytes, str, int, dict
    assert isinstance(value, list) and isinstance(value[0], str), value
    if value[0] == "sched_stats":
        return None
    assert value[0] == "tok", f"unexpected frame tag {value[0]!r}"
    tok = fields_of(value[1:], TOK_FIELDS, TOK_DEFAULTS)
    n = len(tok["req_ids"]) // 8
    rows: dict[str, Any] = {
        "req_ids": np.frombuffer(tok["req_ids"], dtype="<i8").tolist(),
        "counts": np.frombuffer(tok["output_counts"], dtype="<i4").tolist(),
        "completion": np.frombuffer(tok["completion_tokens"], dtype="<i4").tolist(),
    }
    tokens = np.frombuffer(tok["output_ids"], dtype="<i4").tolist()
    assert sum(rows["counts"]) == len(tokens)
    starts = np.concatenate([[0], np.cumsum(rows["counts"])]).tolist()
    rows["tokens"] = [tokens[starts[i] : starts[i + 1]] for i in range(n)]
    rows["finished"] = (
        tok["finished_reasons"] if tok["finished_reasons"] is not None else [None] * n
    )
    raw_stats = tok["request_stats"]
    rows["stats_present"] = raw_stats is not None
    rows["stats"] = (
        [None if s is None else fields_of(s, STATS_FIELDS, STATS_DEFAULTS) for s in raw_stats]
        if raw_stats is not None
        else [None] * n
    )
    assert tok["usage"] is not None, (
        "--dense-usage-columns is on: every token frame must carry usage"
    )
    usage = fields_of(tok["usage"], USAGE_FIELDS, {})
    columns = {name: np.frombuffer(usage[name], dtype="<i4").tolist() for name in USAGE_FIELDS}
    assert all(len(col) == n for col in columns.values()), (
        "a usage column must have one value per row"
    )
    rows["usage"] = [{name: columns[name][i] for name in USAGE_FIELDS} for i in range(n)]
    for key in ("finished", "stats"):
        assert len(rows[key]) == n
    rows["n"] = n
    return rows


# --- end to end: the scheduler alone, and a stateless consumer on its output socket -----


def _media_ids() -> dict[str, int]:
    tok = load_tokenizer(None).tokenizer
    ids = {kind: tok.token_to_id(f"<|{kind}|>") for kind in ("image", "audio", "video")}
    assert all(v is not None for v in ids.values())
    return ids  # type: ignore[return-value]


def _prompt(
    media_ids: dict[str, int], media: dict[str, int], text: list[int]
) -> tuple[list[int], tuple[MediaItem, ...]]:
    """Placeholders in front (images, then audio, then video), as the tokenizer manager does."""
    ids: list[int] = []
    items = []
    for kind in ("image", "audio", "video"):
        if media.get(kind):
            ids += [media_ids[kind]] * media[kind]
            items.append(MediaItem(kind, media[kind]))  # type: ignore[arg-type]
    return ids + text, tuple(items)


def test_stateless_consumer_reads_dense_usage_on_every_row() -> None:
    rng = np.random.default_rng(7)
    media_ids = _media_ids()

    def text(n: int) -> list[int]:
        return rng.integers(100, 4000, size=n).tolist()

    # Phase 1: four requests at once, different prompt lengths and media mixes, nothing cached.
    # Phase 2, after phase 1 has finished (its KV is then in the prefix cache): two requests
    # that share a prefix with phase-1 requests.
    p1, m1 = _prompt(media_ids, {"image": 6}, text(20))
    p2, m2 = _prompt(media_ids, {"audio": 4, "video": 8}, text(9))
    p3, m3 = _prompt(media_ids, {}, text(33))
    p4, m4 = _prompt(media_ids, {"image": 2, "audio": 3, "video": 5}, text(57))
    tail5 = [t for t in text(16) if t != p3[30]][:12]
    p5, m5 = p3[:30] + tail5, ()  # 30 tokens shared with request 3
    tail6 = [t for t in text(16) if t != p1[20]][:7]
    p6, m6 = (
        p1[:20] + tail6,
        (MediaItem("image", 6),),
    )  # 6 image placeholders + 14 text tokens shared with request 1
    phases = [
        {1: (p1, m1, 9), 2: (p2, m2, 6), 3: (p3, m3, 7), 4: (p4, m4, 5)},
        {5: (p5, m5, 6), 6: (p6, m6, 8)},
    ]
    expected_cached = {1: 0, 2: 0, 3: 0, 4: 0, 5: 30, 6: 20}

    ports = [free_port() for _ in range(3)]
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(f"tcp://127.0.0.1:{ports[1]}")  # the detokenizer's endpoint: we are its consumer
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{ports[0]}")
    proc = role_process(
        "scheduler",
        "--scheduler-input", f"tcp://127.0.0.1:{ports[0]}",
        "--detokenizer-input", f"tcp://127.0.0.1:{ports[1]}",
        "--tokenizer-input", f"tcp://127.0.0.1:{ports[2]}",
        "--dense-usage-columns", "--log-level", "warning", "--max-total-tokens", "4096",
    )  # fmt: skip
    encoder = msgspec.msgpack.Encoder()
    seen: dict[int, list[dict[str, Any]]] = {}  # req_id -> its rows, in order
    finished: set[int] = set()
    rows_without_stats = 0
    frames = 0
    try:
        for phase in phases:
            for req_id, (ids, media, max_new) in phase.items():
                push.send(
                    encoder.encode(
                        TokenizedGenerateReqInput(
                            rid=f"dense-{req_id}",
                            req_id=req_id,
                            input_ids=ids,
                            sampling_params=SamplingParams(
                                max_new_tokens=max_new,
                                temperature=0.0,
                                ignore_eos=True,
                                stream_interval=1,
                            ),
                            stream=True,
                            arrival_time=time.time(),
                            media=media,
                        )
                    )
                )
            deadline = time.monotonic() + 180
            while not set(phase) <= finished:
                assert proc.alive(), (
                    f"the scheduler exited with {proc.proc.returncode}:\n{proc.output()[-4000:]}"
                )
                assert time.monotonic() < deadline, (
                    f"requests {sorted(set(phase) - finished)} never finished"
                )
                if not pull.poll(200):
                    continue
                rows = decode_token_frame(pull.recv())
                if rows is None:
                    continue
                frames += 1
                for i in range(rows["n"]):
                    req_id = rows["req_ids"][i]
                    assert req_id not in finished, (
                        f"a row for req_id {req_id} after its finished row"
                    )
                    row = {
                        key: rows[key][i]
                        for key in ("tokens", "counts", "completion", "finished", "stats", "usage")
                    }
                    seen.setdefault(req_id, []).append(row)
                    rows_without_stats += row["stats"] is None
                    if row["finished"] is not None:
                        finished.add(req_id)
    finally:
        code = proc.stop(timeout=30)
        ctx.destroy(linger=0)
    assert code in (0, -15), f"the scheduler exited with {code}:\n{proc.output()[-4000:]}"

    specs = {req_id: spec for phase in phases for req_id, spec in phase.items()}
    assert set(seen) == set(specs)
    assert rows_without_stats > 0, "no row without stats: the test proves nothing about steady rows"
    for req_id, (ids, media, max_new) in specs.items():
        want = {
            "prompt_tokens": len(ids),
            "cached_tokens": expected_cached[req_id],
            "image_tokens": sum(m.num_tokens for m in media if m.kind == "image"),
            "audio_tokens": sum(m.num_tokens for m in media if m.kind == "audio"),
            "video_tokens": sum(m.num_tokens for m in media if m.kind == "video"),
        }
        rows = seen[req_id]
        assert len(rows) == max_new, (
            f"req_id {req_id}: stream_interval 1 should give one row per token"
        )
        assert [r["completion"] for r in rows] == list(range(1, max_new + 1))
        assert (
            rows[0]["stats"] is not None and rows[-1]["stats"] is not None
        )  # first and finished rows
        assert rows[-1]["finished"] == ["length", max_new]
        for k, row in enumerate(rows):
            assert row["usage"] == want, f"req_id {req_id} row {k}: dense {row['usage']} != {want}"
            if row["stats"] is not None:
                assert {name: row["stats"][name] for name in USAGE_FIELDS} == row["usage"], (
                    f"req_id {req_id} row {k}"
                )
        details = rows[0]["stats"]["cached_tokens_details"]
        if want["cached_tokens"]:
            assert details == {"device": want["cached_tokens"], "host": 0}
        else:
            assert details is None
    assert frames >= 2


# --- in process: the builder, the flag, the frame with the flag off ---------------------


# The requests of these in-process tests share one stats-pending set, as one scheduler's do.
PENDING = StatsPending()


def _req(req_id: int, ids: list[int], media: tuple[MediaItem, ...] = (), interval: int = 1) -> Req:
    return Req(
        rid=f"r{req_id}",
        req_id=req_id,
        input_ids=ids,
        sampling=SamplingParams(max_new_tokens=8),
        stream=True,
        stream_interval=interval,
        arrival_time=0.0,
        stats_pending=PENDING,
        media=media,
        collect_time_stats=False,
    )


def _usage(frame: BatchTokenIDOutput) -> list[tuple[int, ...]]:
    assert frame.usage is not None
    cols = [
        np.frombuffer(getattr(frame.usage, name), dtype="<i4").tolist() for name in USAGE_FIELDS
    ]
    return list(zip(*cols))


def test_dense_columns_follow_each_reqs_current_stats() -> None:
    reqs = [
        _req(1, [3] * 4 + [200] * 6, (MediaItem("image", 4),)),
        _req(2, [200, 201]),
        _req(3, [4, 5, 5, 300], (MediaItem("audio", 1), MediaItem("video", 2))),
    ]
    for r in reqs:
        r.output_ids.append(1000)
    first = build_token_output(reqs, PENDING, dense_usage=True)
    assert first.request_stats is not None and all(s is not None for s in first.request_stats)
    assert _usage(first) == [(10, 0, 4, 0, 0), (2, 0, 0, 0, 0), (4, 0, 0, 1, 2)]

    # A stats change shows in the dense columns on the very next row, and in request_stats
    # only on that request's row (it is due there); the other rows carry None.
    reqs[1].update_stats(cached_tokens=1)
    for r in reqs:
        r.output_ids.append(1001)
    second = build_token_output(reqs, PENDING, dense_usage=True)
    assert second.request_stats is not None
    assert [s is None for s in second.request_stats] == [True, False, True]
    assert _usage(second) == [(10, 0, 4, 0, 0), (2, 1, 0, 0, 0), (4, 0, 0, 1, 2)]

    for r in reqs:
        r.output_ids.append(1002)
    steady = build_token_output(reqs, PENDING, dense_usage=True)
    assert steady.request_stats is None
    assert _usage(steady) == _usage(second)

    empty = build_token_output([], PENDING, dense_usage=True)
    assert empty.usage is not None and empty.usage.prompt_tokens == b""


class _TokFrameBefore(msgspec.Struct, tag="tok", array_like=True, gc=False):
    """``BatchTokenIDOutput`` as it was before ``usage`` was appended."""

    req_ids: bytes
    output_ids: bytes
    output_counts: bytes
    completion_tokens: bytes
    finished_reasons: list[Any] | None = None
    request_stats: list[Any] | None = None
    decode_options: list[Any] | None = None


def test_flag_off_leaves_usage_none_and_adds_one_nil_byte() -> None:
    """msgspec writes every field of an array_like struct (``omit_defaults`` does not drop
    trailing defaults there), so the appended field costs exactly its ``nil`` byte when the
    flag is off (and so does the logprobs field after it, when no row asked). Every other byte
    matches the frame from before the field existed, which decodes with the new type as
    usage=None. A new frame decodes with the old type, which ignores the extra element."""
    reqs = [_req(i, [200 + i] * (3 + i)) for i in range(1, 65)]
    for r in reqs:
        r.output_ids.append(1000)
    build_token_output(reqs, PENDING)  # first rows: stats and decode options
    for r in reqs:
        r.output_ids.append(1001)
    steady = build_token_output(reqs, PENDING)
    assert steady.usage is None and steady.request_stats is None and steady.finished_reasons is None
    new = msgspec.msgpack.encode(steady)
    before = msgspec.msgpack.encode(
        _TokFrameBefore(
            req_ids=steady.req_ids,
            output_ids=steady.output_ids,
            output_counts=steady.output_counts,
            completion_tokens=steady.completion_tokens,
        )
    )
    assert before[0] == 0x98 and new[0] == 0x9A  # fixarray of 8, then of 10 (usage, then logprobs)
    assert new == b"\x9a" + before[1:] + b"\xc0\xc0"
    assert len(new) == len(before) + 2
    assert msgspec.msgpack.decode(before, type=BatchTokenIDOutput) == steady
    assert msgspec.msgpack.decode(new, type=_TokFrameBefore).req_ids == steady.req_ids
    on = build_token_output(reqs, PENDING, dense_usage=True)
    assert (
        msgspec.msgpack.decode(msgspec.msgpack.encode(on), type=_TokFrameBefore).output_counts
        == on.output_counts
    )


def test_flag_parses_and_travels_in_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    assert config_from_args(parser.parse_args([]), environ={}).dense_usage_columns is False
    config = config_from_args(parser.parse_args(["--dense-usage-columns"]), environ={})
    assert config.dense_usage_columns is True
    assert (
        ServerConfig.decode(config.encode()).dense_usage_columns is True
    )  # the supervisor's --config-json


def test_docs_worked_example_is_what_the_code_writes() -> None:
    """The hex dump in docs/wire.md section 7, rebuilt from the code that it shows."""
    a = _req(7, [3, 3, 300, 301, 302], (MediaItem("image", 2),))
    a.update_stats(cached_tokens=3, cached_tokens_details=CachedTokensDetails(device=3, host=0))
    a.output_ids = [1000]
    b = _req(8, [4, 310, 311, 312], (MediaItem("audio", 1),))
    b.take_request_stats_due()
    b.take_decode_options_due()
    b.output_ids = [1001, 1002]
    b.num_sent_tokens = 1
    c = _req(9, [320, 321, 322], interval=2)
    c.take_request_stats_due()
    c.take_decode_options_due()
    c.output_ids = [1003, 1004, 0]
    c.num_sent_tokens = 1
    c.finish(FinishStop(matched=0))
    data = msgspec.msgpack.encode(build_token_output([a, b, c], PENDING, dense_usage=True))

    doc = (Path(REPO) / "docs" / "wire.md").read_text()
    block = re.search(r"<!-- wire-example-begin -->\s*```\n(.*?)```", doc, re.S)
    assert block is not None
    documented = bytes.fromhex("".join(line[6:] for line in block.group(1).splitlines()))
    assert data == documented

    rows = decode_token_frame(data)
    assert rows is not None
    assert rows["req_ids"] == [7, 8, 9] and rows["tokens"] == [[1000], [1002], [1004, 0]]
    assert rows["finished"] == [None, None, ["stop", 0]]
    assert rows["stats"][1] is None
    assert rows["usage"][1] == {
        "prompt_tokens": 4,
        "cached_tokens": 0,
        "image_tokens": 0,
        "audio_tokens": 1,
        "video_tokens": 0,
    }


@pytest.mark.parametrize("n", [1, 512])
def test_flag_off_does_no_per_row_usage_work(n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import scheduler_proc.output_builder as ob

    def boom(_reqs: Any) -> Any:
        raise AssertionError("usage columns built with the flag off")

    monkeypatch.setattr(ob, "build_usage_columns", boom)
    reqs = [_req(i, [200, 201]) for i in range(n)]
    for r in reqs:
        r.output_ids.append(1000)
    assert build_token_output(reqs, PENDING).usage is None
