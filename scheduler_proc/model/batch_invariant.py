"""The kernels of ``--enable-deterministic-inference``: a row's result does not depend on the
other rows of its pass, so a token's logits are the same bits whether its prompt was
prefilled whole, chunked, served from the prefix cache or decoded beside any neighbours.

Each function works around one way the CPU kernels tie a row's bits to its pass. What each
relies on was measured, not promised by the libraries: ``docs/design/determinism.md`` says
what, and ``tests/unit/test_batch_invariant.py`` checks it on the machine that runs it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

# A matmul of fewer rows takes other code paths (below 4 rows; on several threads, 5 to 11
# rows too), each summing in its own order. From 12 rows on, a row's bits were the same at any
# row count and place, 1 to 14 threads; 16 leaves a margin.
MIN_GEMM_ROWS = 16

# ATen runs an elementwise op of fewer values than this on one thread (at::internal::GRAIN_SIZE).
SERIAL_VALUES = 32768

# A multiple of every CPU build's vector step (2 * Vec::size() values: 32 floats on AVX512,
# 64 bfloat16s).
VECTOR_STEP = 64

# The probabilities times the values are summed over key blocks of this many columns, one
# block after the other: a matmul over all the columns splits the sum by the column count
# (seen for 200 to 368 columns at 4 query heads of 128), so a row's bits moved with the
# batch's longest row. Decode and per-query passes pad the key columns to a multiple of it.
KEY_BLOCK = 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of x [M, K], each row the same bits at any M: a pass of fewer than
    ``MIN_GEMM_ROWS`` rows is padded with zero rows to that many."""
    rows = x.shape[0]
    if rows >= MIN_GEMM_ROWS:
        return F.linear(x, weight, bias)
    padded = F.pad(x, (0, 0, 0, MIN_GEMM_ROWS - rows))
    return F.linear(padded, weight, bias)[:rows]


def silu(x: torch.Tensor) -> torch.Tensor:
    """``F.silu`` of x [M, N], each row the same bits at any M and thread count.

    An elementwise op computes each thread's share of the values in vectors, and the share's
    last few values one at a time; the vector exp and the scalar one differ in the last bit
    for about 4% of inputs, and where the shares end moves with M. Here every call is
    serial, on whole rows (or row segments of a multiple of ``VECTOR_STEP``), written into a
    strided output so that ATen loops row by row: each row takes the same vector and scalar
    lanes wherever it sits."""
    rows, width = x.shape
    out = x.new_empty((rows, width + VECTOR_STEP))[:, :width]
    cols = width if width < SERIAL_VALUES else SERIAL_VALUES - VECTOR_STEP
    per = max(1, (SERIAL_VALUES - 1) // cols)
    if torch.get_num_threads() == 1 and cols == width:
        per = rows  # serial anyway: one call
    for c in range(0, width, cols):
        for r in range(0, rows, per):
            torch.ops.aten.silu.out(
                x[r : r + per, c : c + cols], out=out[r : r + per, c : c + cols]
            )
    return out


def key_columns(max_kv_len: int, align: int) -> int:
    """``max_kv_len`` rounded up to a multiple of ``align``."""
    return -(-max_kv_len // align) * align


def weighted_values(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(probs, values)`` for probs [N, G, L] and values [N, L, D], L a multiple of
    ``KEY_BLOCK``: each block of ``KEY_BLOCK`` keys is one product of a fixed shape, and the
    blocks' sums are added in order. Padded keys weigh 0, so a row's bits depend on its own
    keys only, not on L."""
    n, g, width = probs.shape
    if width % KEY_BLOCK:
        raise ValueError(f"weighted_values: {width} key columns, not a multiple of {KEY_BLOCK}")
    blocks = width // KEY_BLOCK
    if values.stride(0) == 0:
        # One sequence's values for every row (a prefill's tokens): a product per block reads
        # them as they are, where the batched product below would copy them for every row.
        return _in_order(
            torch.bmm(probs[..., c : c + KEY_BLOCK], values[:, c : c + KEY_BLOCK])
            for c in range(0, width, KEY_BLOCK)
        )
    by_block = probs.view(n, g, blocks, KEY_BLOCK).transpose(1, 2)  # [N, blocks, G, KEY_BLOCK]
    parts = torch.matmul(by_block, values.view(n, blocks, KEY_BLOCK, -1))  # [N, blocks, G, D]
    return _in_order(parts[:, b] for b in range(blocks))


def _in_order(parts: Iterator[torch.Tensor]) -> torch.Tensor:
    """The sum of the block products, first to last (the same bits both ways above)."""
    out = next(parts)
    for part in parts:
        out = out + part
    return out
