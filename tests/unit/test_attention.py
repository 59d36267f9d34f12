"""Attention over the KV pool (scheduler_proc/model/attention.py): the head-major decode path
must give what the padded SDPA path and a float64 textbook attention give, on pools with
ragged lengths, GQA and shuffled slots; a row's output must not depend on the other rows of
its batch; and a pass goes down the decode path only when it is a decode pass."""

from __future__ import annotations

import os

import pytest
import torch

from scheduler_proc.model.forward_batch import DECODE_KEY_ALIGN, AttentionLayout, ForwardBatch
from scheduler_proc.model.attention import padded_attention, pool_attention
from scheduler_proc.model.host_memory import keep_freed_host_memory

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 32  # GQA: two query heads per kv head
SLOTS = 512
ATOL = 1e-5


def rotary_tables(positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Any finite rows do: attention reads only the layout's slot table, mask and lengths.
    angles = (
        torch.arange(positions, dtype=torch.float32)[:, None]
        * torch.linspace(0.1, 1.0, HEAD_DIM)[None, :]
    )
    return angles.cos(), angles.sin()


class Pool:
    """One layer's K and V pool filled with random keys, and sequences living in it at
    shuffled slots."""

    def __init__(self, seed: int, dtype: torch.dtype = torch.float32) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.k = torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=self.gen).to(dtype)
        self.v = torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=self.gen).to(dtype)
        self.free = torch.randperm(SLOTS, generator=self.gen).tolist()
        self.dtype = dtype

    def slots(self, n: int) -> torch.Tensor:
        taken, self.free = self.free[:n], self.free[n:]
        return torch.tensor(taken, dtype=torch.long)

    def new_tokens(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [n, H, D], k and v [n, KH, D] of n new tokens."""
        shapes = ((n, HEADS, HEAD_DIM), (n, KV_HEADS, HEAD_DIM), (n, KV_HEADS, HEAD_DIM))
        q, k, v = (torch.randn(shape, generator=self.gen).to(self.dtype) for shape in shapes)
        return q, k, v


def decode_batch(pool: Pool, prefixes: list[torch.Tensor]) -> tuple[ForwardBatch, AttentionLayout]:
    """A decode pass: each sequence's prefix slots, then one new slot."""
    new = [pool.slots(1) for _ in prefixes]
    batch = ForwardBatch.build([[1] for _ in prefixes], prefixes, new, "cpu")
    cos, sin = rotary_tables(int(batch.kv_lens.max()) + 1)
    return batch, AttentionLayout.from_batch(batch, cos, sin, pool.dtype)


def reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """Textbook float64 attention of each sequence's one new token over its own keys."""
    out = []
    groups = HEADS // KV_HEADS
    for b in range(batch.batch_size):
        slots = batch.kv_slot_table[b, : int(batch.kv_lens[b])]
        keys = k_cache[slots].double().repeat_interleave(groups, 1)  # [L, H, D]
        values = v_cache[slots].double().repeat_interleave(groups, 1)
        scores = torch.einsum("hd,lhd->hl", q[b].double(), keys) * scale
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), values))
    return torch.stack(out)


def run(
    path: str,
    pool: Pool,
    layout: AttentionLayout,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    """One path on copies of the pool (both paths write the new keys first)."""
    k_cache, v_cache = pool.k.clone(), pool.v.clone()
    scale = HEAD_DIM**-0.5
    if path == "decode":
        assert (
            layout.is_decode and layout.row_kv is None
        )  # the pool gather; test_row_kv.py reads the copy
        return pool_attention(q, k, v, layout, k_cache, v_cache, scale, 0)
    return padded_attention(q, k, v, layout, k_cache, v_cache, scale)


def ragged_prefixes(pool: Pool, lengths: list[int]) -> list[torch.Tensor]:
    return [pool.slots(n) for n in lengths]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decode_path_equals_padded_sdpa_and_float64_reference(seed: int) -> None:
    pool = Pool(seed)
    lengths = torch.randint(1, 40, (12,), generator=pool.gen).tolist()
    batch, layout = decode_batch(pool, ragged_prefixes(pool, lengths))
    q, k, v = pool.new_tokens(batch.batch_size)
    fast, padded = run("decode", pool, layout, q, k, v), run("padded", pool, layout, q, k, v)
    k_cache, v_cache = pool.k.clone(), pool.v.clone()
    k_cache[batch.out_slots], v_cache[batch.out_slots] = k, v
    expected = reference(q, k_cache, v_cache, batch, HEAD_DIM**-0.5)
    assert fast.shape == (batch.batch_size, HEADS, HEAD_DIM)
    torch.testing.assert_close(fast, padded, atol=ATOL, rtol=0)
    torch.testing.assert_close(fast.double(), expected, atol=ATOL, rtol=0)


def test_decode_path_writes_the_new_keys_and_values() -> None:
    pool = Pool(3)
    batch, layout = decode_batch(pool, ragged_prefixes(pool, [5, 1, 9]))
    q, k, v = pool.new_tokens(3)
    k_cache, v_cache = pool.k.clone(), pool.v.clone()
    pool_attention(q, k, v, layout, k_cache, v_cache, HEAD_DIM**-0.5, 0)
    assert torch.equal(k_cache[batch.out_slots], k) and torch.equal(v_cache[batch.out_slots], v)
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[batch.out_slots] = False
    assert torch.equal(k_cache[untouched], pool.k[untouched]) and torch.equal(
        v_cache[untouched], pool.v[untouched]
    )


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_a_rows_output_does_not_depend_on_its_batch(seed: int) -> None:
    """The same sequence (same slots, same new token) alone, and beside longer and shorter
    neighbours in either order: the decode path gives the same bits (its key columns are
    padded to DECODE_KEY_ALIGN, so the batch's longest row only adds exact zeros). That is
    what keeps a seeded request's tokens the same alone and in a batch."""
    pool = Pool(seed)
    mine = pool.slots(int(torch.randint(1, 60, (1,), generator=pool.gen)))
    others = ragged_prefixes(pool, torch.randint(1, 120, (3,), generator=pool.gen).tolist())
    q, k, v = pool.new_tokens(4)
    batch, layout = decode_batch(pool, [mine])
    slot = batch.out_slots  # the row's one new slot, reused in every batch below
    alone = run("decode", pool, layout, q[:1], k[:1], v[:1])[0]
    new = [slot, *(pool.slots(1) for _ in others)]
    cos, sin = rotary_tables(200)
    for order in ([0, 1, 2, 3], [3, 2, 0, 1]):
        prefixes = [mine, *others]
        batch = ForwardBatch.build(
            [[1]] * 4, [prefixes[i] for i in order], [new[i] for i in order], "cpu"
        )
        layout = AttentionLayout.from_batch(batch, cos, sin, torch.float32)
        out = run("decode", pool, layout, q[order], k[order], v[order])
        assert torch.equal(out[order.index(0)], alone), (out[order.index(0)] - alone).abs().max()


def test_only_a_decode_pass_takes_the_decode_path() -> None:
    pool = Pool(5)
    prefixes = ragged_prefixes(pool, [4, 7])
    cos, sin = rotary_tables(32)
    # Prefill chunks (two new tokens for one sequence) and a dLLM block: the padded path, exactly.
    mixed = ForwardBatch.build([[1, 2], [3]], prefixes, [pool.slots(2), pool.slots(1)], "cpu")
    dllm = ForwardBatch.build(
        [[1], [2]], prefixes, [pool.slots(1), pool.slots(1)], "cpu", bidirectional_from=[4, 7]
    )
    for batch in (mixed, dllm):
        layout = AttentionLayout.from_batch(batch, cos, sin, torch.float32)
        assert not layout.is_decode
        with pytest.raises(ValueError, match="not a decode pass"):
            layout.decode_reads(KV_HEADS)
        q, k, v = pool.new_tokens(batch.num_tokens)
        got = pool_attention(q, k, v, layout, pool.k.clone(), pool.v.clone(), HEAD_DIM**-0.5, 0)
        assert torch.equal(got, run("padded", pool, layout, q, k, v))
    batch, layout = decode_batch(pool, prefixes)
    assert layout.is_decode
    q, k, v = pool.new_tokens(2)
    got = pool_attention(q, k, v, layout, pool.k.clone(), pool.v.clone(), HEAD_DIM**-0.5, 0)
    assert torch.equal(got, run("decode", pool, layout, q, k, v))


def test_decode_reads_are_built_once_per_pass() -> None:
    pool = Pool(6)
    _, layout = decode_batch(pool, ragged_prefixes(pool, [3, 6]))
    reads = layout.decode_reads(KV_HEADS)
    assert layout.decode_reads(KV_HEADS) is reads
    # 7 columns (the longer row's 6 keys and its new one), read as DECODE_KEY_ALIGN.
    assert reads.rows is not None and reads.rows.shape == (2 * KV_HEADS * DECODE_KEY_ALIGN,)
    assert reads.bias.shape == (2 * KV_HEADS, 1, DECODE_KEY_ALIGN)
    # Row 0 has 4 keys: every later column is padding, for every kv head.
    assert (
        torch.isinf(reads.bias[:KV_HEADS, 0, 4:]).all()
        and (reads.bias[:KV_HEADS, 0, :4] == 0).all()
    )
    assert (reads.bias[KV_HEADS:, 0, :7] == 0).all() and torch.isinf(
        reads.bias[KV_HEADS:, 0, 7:]
    ).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_decode_stays_close_to_padded_sdpa(dtype: torch.dtype) -> None:
    pool = Pool(7, dtype)
    batch, layout = decode_batch(pool, ragged_prefixes(pool, [30, 2, 11]))
    q, k, v = pool.new_tokens(batch.batch_size)
    fast, padded = run("decode", pool, layout, q, k, v), run("padded", pool, layout, q, k, v)
    assert fast.dtype == dtype and bool(torch.isfinite(fast).all())
    torch.testing.assert_close(fast.float(), padded.float(), atol=2e-2, rtol=0)


def test_host_memory_setting_is_idempotent_and_reports_glibc() -> None:
    try:
        on_glibc = bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (AttributeError, ValueError, OSError):
        on_glibc = False
    assert keep_freed_host_memory() is on_glibc
    assert keep_freed_host_memory() is on_glibc


def test_scale_is_applied_once() -> None:
    """A scale of 0 makes every key weigh the same: the output is each row's mean value."""
    pool = Pool(8)
    batch, layout = decode_batch(pool, ragged_prefixes(pool, [6, 2]))
    q, k, v = pool.new_tokens(2)
    k_cache, v_cache = pool.k.clone(), pool.v.clone()
    out = pool_attention(q, k, v, layout, k_cache, v_cache, 0.0, 0)
    for b in range(2):
        slots = batch.kv_slot_table[b, : int(batch.kv_lens[b])]
        mean = v_cache[slots].mean(0).repeat_interleave(HEADS // KV_HEADS, 0)
        torch.testing.assert_close(out[b], mean, atol=ATOL, rtol=0)
