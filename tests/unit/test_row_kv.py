"""The running batch's dense KV copy (scheduler_proc/cache/row_kv.py).

A decode pass that reads the copy must give the same bits as one that gathers from the
pool, through everything that makes a row of the copy stale or reshapes it: requests
joining and leaving (swap-remove moves the last row into the hole), a retracted request
coming back, slots freed and reused by another request, prefix-cache hits, the width
growing past each multiple of 16 and shrinking when the longest row leaves, the row count
growing, and passes that exceed the budget (they read the pool) between passes that fit.
The real scheduler is run twice on one workload, the copy on and off, and every token and
logprob must be equal."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from pipeline.config import ServerConfig
from pipeline.io_struct import (
    REQ_ID_DTYPE,
    BatchTokenIDOutput,
    LogprobParams,
    SamplingParams,
    TokenizedGenerateReqInput,
)
from pipeline.columns import from_column, split_token_rows
from pipeline.logprob_columns import read_output_logprobs
from scheduler_proc.model.forward_batch import AttentionLayout, ForwardBatch, decode_key_columns
from scheduler_proc.cache.kv_pool import KVPool
from scheduler_proc.cache.row_kv import NoRowKV, RowKV, _move_rows
from scheduler_proc.main import build_scheduler
from scheduler_proc.model.attention import pool_attention
from scheduler_proc.scheduler import Scheduler

ASK = LogprobParams(top_logprobs_num=3)


def _requests() -> list[tuple[list[int], SamplingParams, int]]:
    """(prompt, sampling, the step it arrives at): ragged prompts (one past 16 columns, one
    past 64), outputs that end at different steps, two prompts sharing a 24-token prefix
    (a prefix-cache hit), greedy and seeded rows, late arrivals."""
    shared = [(11 * i) % 3000 + 90 for i in range(24)]
    out = []
    for j in range(14):
        prompt = (
            shared + [j + 100] * (j % 3)
            if j in (3, 9)
            else [(7 * i + 13 * j) % 3900 + 60 for i in range(5 + 6 * j)]
        )
        sampling = (
            SamplingParams(temperature=0.0)
            if j % 2
            else SamplingParams(temperature=0.8, top_p=0.9, seed=j)
        )
        out.append(
            (
                prompt,
                msgspec.structs.replace(sampling, max_new_tokens=6 + (5 * j) % 37, ignore_eos=True),
                3 * (j // 4),
            )
        )
    return out


def _run(s: Scheduler) -> dict[int, tuple[list[int], list[Any]]]:
    """Every request's tokens and logprob entries, read back from encoded frames."""
    pending = list(enumerate(_requests()))
    got: dict[int, tuple[list[int], list[Any]]] = {}
    step = 0
    while pending or s.has_work():
        while pending and pending[0][1][2] <= step:
            req_id, (prompt, sampling, _) = pending.pop(0)
            s.add_request(
                TokenizedGenerateReqInput(
                    rid=f"r{req_id}", req_id=req_id, input_ids=prompt, sampling_params=sampling,
                    stream=True, arrival_time=time.time(), logprobs=ASK,
                )
            )  # fmt: skip
        step += 1
        for frame in s.step():
            assert isinstance(frame, BatchTokenIDOutput)
            frame = msgspec.msgpack.decode(msgspec.msgpack.encode(frame), type=BatchTokenIDOutput)
            rows = split_token_rows(frame.output_ids, frame.output_counts)
            per_row = (
                read_output_logprobs(frame.logprobs.output, [len(r) for r in rows])
                if frame.logprobs and frame.logprobs.output
                else {}
            )
            for i, (req_id, row) in enumerate(
                zip(from_column(frame.req_ids, REQ_ID_DTYPE).tolist(), rows)
            ):
                tokens, entries = got.setdefault(req_id, ([], []))
                tokens.extend(row)
                if i in per_row:
                    entries.extend(zip(per_row[i].chosen, per_row[i].top))
    return got


def _spy(
    monkeypatch: pytest.MonkeyPatch, name: str, calls: list[Any], result: bool = False
) -> None:
    original: Callable[..., Any] = getattr(RowKV, name)

    def spy(self: RowKV, *args: Any) -> Any:
        out = original(self, *args)
        calls.append(out if result else args)
        return out

    monkeypatch.setattr(RowKV, name, spy)


@pytest.mark.parametrize("pool", [8192, 400], ids=["roomy", "retracting"])
def test_decode_through_the_copy_equals_decode_through_the_pool(
    pool: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    off = build_scheduler(
        ServerConfig(max_total_tokens=pool, torch_threads=1, decode_kv_rows="off")
    )
    assert isinstance(off.runner.row_kv, NoRowKV)
    expected = _run(off)
    assert [len(expected[i][0]) for i in range(len(expected))] == [
        r[1].max_new_tokens for r in _requests()
    ]

    passes: list[Any] = []
    relayouts: list[Any] = []
    fills: list[Any] = []
    _spy(monkeypatch, "prepare", passes, result=True)
    _spy(monkeypatch, "_relayout", relayouts)
    _spy(monkeypatch, "_fill", fills)
    on = build_scheduler(ServerConfig(max_total_tokens=pool, torch_threads=1, decode_kv_rows="on"))
    got = _run(on)
    assert got == expected  # tokens and logprob values, bit for bit

    # The workload really went through what it is meant to cover.
    assert sum(p is not None for p in passes) > 20
    widths = [width for _, width, _ in relayouts]
    assert any(b > a for a, b in zip(widths, widths[1:])) and any(
        b < a for a, b in zip(widths, widths[1:])
    )
    assert any(
        len(stale) == 1 for _, _, stale, _ in fills
    )  # a single row refilled: a join or a swap-remove
    if pool == 400:
        assert on.num_retracted_total > 0 and on.num_retracted_total == off.num_retracted_total
        assert any(p is None for p in passes)  # over budget: those passes read the pool


def test_the_copy_is_on_by_default_on_the_cpu_and_bounded_by_the_pool() -> None:
    s = build_scheduler(ServerConfig(max_total_tokens=512, torch_threads=1))
    assert isinstance(s.runner.row_kv, RowKV)
    pool = s.runner.kv
    row_kv = RowKV(pool, 512)
    table = torch.zeros((8, 70), dtype=torch.long)
    joined, seq_len = np.arange(8), np.full(8, 70)
    assert row_kv.prepare(joined, seq_len, table, decode_key_columns(70)) is None  # 8 * 80 > 512
    assert row_kv.shape == (0, 0)
    assert (
        row_kv.prepare(joined[:6], seq_len[:6], table[:6], decode_key_columns(70)) is not None
    )  # 6 * 80 <= 512
    assert row_kv.shape == (6, 80)
    assert row_kv.prepare(joined, seq_len, table, decode_key_columns(70)) is None
    assert row_kv.shape == (0, 0)  # dropped, to be built again when a pass fits
    with pytest.raises(ValueError, match="budget_tokens must be positive"):
        RowKV(pool, 0)


@pytest.mark.parametrize(
    ("old", "new", "kept"),
    [
        ((5, 16), (5, 32), 5),  # wider
        ((5, 32), (5, 16), 5),  # narrower: rows move down
        ((3, 16), (8, 32), 3),  # more rows, wider
        ((8, 48), (4, 16), 4),  # fewer rows, narrower
        ((8, 16), (4, 48), 4),  # fewer rows but wider: the whole-copy staging
        ((4, 48), (9, 16), 4),  # more rows but narrower
        ((6, 32), (6, 32), 2),  # same shape, fewer rows kept
    ],
)
def test_a_relayout_keeps_each_kept_row_and_zeroes_new_columns(
    old: tuple[int, int], new: tuple[int, int], kept: int
) -> None:
    layers, heads, dim = 3, 2, 4
    (rows, width), (new_rows, new_width) = old, new
    size = layers * max(rows * width, new_rows * new_width) * heads * dim
    gen = torch.Generator().manual_seed(rows * 100 + width)
    store = torch.randn(size, generator=gen)
    before = (
        store[: layers * rows * width * heads * dim].view(layers, rows, heads, width, dim).clone()
    )
    _move_rows(store, (layers, rows, heads, width, dim), new_rows, new_width, kept)
    after = store[: layers * new_rows * new_width * heads * dim].view(
        layers, new_rows, heads, new_width, dim
    )
    cols = min(width, new_width)
    assert torch.equal(after[:, :kept, :, :cols], before[:, :kept, :, :cols])
    assert bool((after[:, :kept, :, cols:] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_the_copy_equals_the_pool_gather(dtype: torch.dtype) -> None:
    """One layer, rows of ragged lengths at shuffled slots, over several passes in which
    one row leaves (swap-remove) and the width crosses a multiple of 16."""
    heads, kv_heads, dim, slots = 8, 4, 16, 400
    gen = torch.Generator().manual_seed(3)
    pool = KVPool(1, slots, kv_heads, dim, dtype, "cpu")
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    free = torch.randperm(slots - 1, generator=gen) + 1  # slot 0 stays the padding slot
    lengths = [3, 14, 9, 15]
    table = torch.zeros((4, 40), dtype=torch.long)
    for r, n in enumerate(lengths):
        table[r, : n + 20] = free[r * 40 : r * 40 + n + 20]
    joined = np.arange(4)
    row_kv = RowKV(pool, 1000)
    cos, sin = torch.ones(64, dim), torch.zeros(64, dim)
    for step in range(6):
        if step == 3:  # row 1 leaves: the last row moves into its place
            table[1], joined, lengths = (
                table[3],
                joined[[0, 3, 2]],
                [lengths[0], lengths[3], lengths[2]],
            )
        n = len(lengths)
        seq = np.array(lengths, dtype=np.int64)
        view = table[:n, : int(seq.max())]
        q, k, v = (
            torch.randn(shape, generator=gen).to(dtype)
            for shape in ((n, heads, dim), (n, kv_heads, dim), (n, kv_heads, dim))
        )
        outs = []
        for copy in (None, row_kv.prepare(joined, seq, view, decode_key_columns(view.shape[1]))):
            batch = ForwardBatch.decode(
                torch.zeros(n, dtype=torch.long), torch.from_numpy(seq), view, "cpu", copy
            )
            layout = AttentionLayout.from_batch(batch, cos, sin, dtype)
            outs.append(pool_attention(q, k, v, layout, pool.k[0], pool.v[0], dim**-0.5, 0))
        assert torch.equal(outs[0], outs[1]), f"step {step}"
        lengths = [x + 1 for x in lengths]
