"""The kernels of deterministic inference (scheduler_proc/model/batch_invariant.py and the
per-query attention path): a row's bits do not depend on the rows around it, at any row
count, place, thread count or key width; and a prefill attends each token exactly as the
decode step of that token would. These are the properties the libraries do not promise, so
they are checked on the machine that runs the suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from scheduler_proc.model import batch_invariant
from scheduler_proc.model.attention import pool_attention
from scheduler_proc.model.batch_invariant import KEY_BLOCK, MIN_GEMM_ROWS
from scheduler_proc.model.forward_batch import AttentionLayout, ForwardBatch

ROW_COUNTS = [1, 2, 3, 5, 7, 11, 13, MIN_GEMM_ROWS, 17, 64, 200]


@pytest.fixture
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch's intra-op threads for the test, put back after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def each_row_alone(f: object, x: torch.Tensor) -> torch.Tensor:
    assert callable(f)
    return torch.cat([f(x[i : i + 1]) for i in range(x.shape[0])])


@pytest.mark.parametrize("threads", [1, 2, 3], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_in,n_out", [(256, 704), (704, 256), (256, 4096)])
def test_a_linear_rows_bits_do_not_depend_on_its_batch(
    threads: int, dtype: torch.dtype, n_in: int, n_out: int
) -> None:
    gen = torch.Generator().manual_seed(n_in + n_out)
    weight = (torch.randn(n_out, n_in, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(n_out, generator=gen).to(dtype)
    x = torch.randn(230, n_in, generator=gen).to(dtype)
    alone = each_row_alone(lambda r: batch_invariant.linear(r, weight, bias), x)
    for rows in ROW_COUNTS:
        for start in (0, 3, 29):
            got = batch_invariant.linear(x[start : start + rows], weight, bias)
            assert torch.equal(got, alone[start : start + rows]), (rows, start)
    # And the result is F.linear's (only the rows around it are chosen).
    torch.testing.assert_close(alone, F.linear(x, weight, bias))


@pytest.mark.parametrize("threads", [1, 3], indirect=True)
@pytest.mark.parametrize("width", [37, 704, 5000, 16384, 40000])
def test_a_silu_rows_bits_do_not_depend_on_its_batch(threads: int, width: int) -> None:
    x = torch.randn(70, width, generator=torch.Generator().manual_seed(width)) * 4
    alone = each_row_alone(batch_invariant.silu, x)
    for rows in (1, 2, 5, 16, 50):
        for start in (0, 7):
            got = batch_invariant.silu(x[start : start + rows])
            assert torch.equal(got, alone[start : start + rows]), (rows, start)
    torch.testing.assert_close(alone, F.silu(x))


@pytest.mark.parametrize("heads,head_dim", [(2, 32), (4, 128), (7, 64)])
@pytest.mark.parametrize("keys", [30, 200, 255, 300, 700])
def test_weighted_values_do_not_depend_on_the_key_width(
    heads: int, head_dim: int, keys: int
) -> None:
    """One row's probabilities over ``keys`` keys, the columns past them padding of weight
    0: the weighted sum is the same bits at every width the batch's longest row could set
    (a plain bmm's is not at 4 heads of 128 and 200 to 368 columns)."""
    gen = torch.Generator().manual_seed(keys)
    probs = torch.softmax(torch.randn(3, heads, keys, generator=gen), -1)
    values = torch.randn(3, keys, head_dim, generator=gen)
    first = -(-keys // KEY_BLOCK) * KEY_BLOCK
    outs = []
    for width in range(first, first + 6 * KEY_BLOCK, KEY_BLOCK):
        p = F.pad(probs, (0, width - keys))
        v = torch.cat([values, torch.randn(3, width - keys, head_dim, generator=gen)], 1)
        outs.append(batch_invariant.weighted_values(p, v))
    assert all(torch.equal(outs[0], out) for out in outs)
    torch.testing.assert_close(outs[0], torch.bmm(probs, values))


HEADS, KV_HEADS, HEAD_DIM, SLOTS = 8, 2, 64, 2048


def layout_of(batch: ForwardBatch, dtype: torch.dtype) -> AttentionLayout:
    positions = int(batch.kv_lens.max()) + 1
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * torch.ones(HEAD_DIM)
    return AttentionLayout.from_batch(batch, angles.cos(), angles.sin(), dtype, deterministic=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefill_attends_each_token_as_its_decode_step_would(dtype: torch.dtype) -> None:
    """Three sequences share the pool: one prefills 300 tokens whole beside a 40-token chunk
    that follows a cached prefix of 260 (and a one-token chunk: a cached prompt's last
    position); then every token of them is attended again as a decode step, in a batch with
    the others' tokens at other positions. Each token's output is the same bits."""
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v_cache = torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    slots = torch.randperm(SLOTS, generator=gen)
    seqs = [slots[:300], slots[300:600], slots[600:900]]
    prefix = [0, 260, 299]  # tokens already in the pool before this pass
    total = sum(len(s) - p for s, p in zip(seqs, prefix))
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    batch = ForwardBatch.build(
        [[1] * (len(s) - p) for s, p in zip(seqs, prefix)],
        [s[:p] for s, p in zip(seqs, prefix)],
        [s[p:] for s, p in zip(seqs, prefix)],
        "cpu",
    )
    layout = layout_of(batch, dtype)
    assert layout.per_query
    prefill = pool_attention(q, k, v, layout, k_cache, v_cache, HEAD_DIM**-0.5, 0)

    # Every new token again, as decode steps of 50 rows each (its KV is in the pool now).
    rows = [(b, i) for b, (s, p) in enumerate(zip(seqs, prefix)) for i in range(p, len(s))]
    order = torch.randperm(len(rows), generator=gen).tolist()
    decoded = torch.empty_like(prefill)
    for start in range(0, len(order), 50):
        picks = order[start : start + 50]
        step = ForwardBatch.build(
            [[1] for _ in picks],
            [seqs[rows[j][0]][: rows[j][1]] for j in picks],
            [seqs[rows[j][0]][rows[j][1] : rows[j][1] + 1] for j in picks],
            "cpu",
        )
        step_layout = layout_of(step, dtype)
        assert step_layout.is_decode
        out = pool_attention(
            q[picks], k[picks], v[picks], step_layout, k_cache, v_cache, HEAD_DIM**-0.5, 0
        )
        decoded[picks] = out
    assert torch.equal(prefill, decoded)
