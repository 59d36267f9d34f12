"""A dense copy of the running batch's KV, one row per running-batch row, so that a decode
pass reads each sequence's keys as one contiguous block instead of gathering them slot by
slot from the pool.

Why: the pool is token-level (the radix cache shares slots between requests), so a decode
pass that reads the pool gathers ``B * KH * L`` rows of ``head_dim`` values at random places,
for keys and again for values, in every layer; on a CPU those reads are bound by memory
latency. Here the keys of running-batch row ``r`` live at ``k[layer, r, :, :L]``, and
``[:n]`` of them is a ``[n * KH, L, D]`` view that the attention's batched matmuls read
directly. A decode pass appends one column per row (the new token's K and V, which it also
writes to the pool, the truth for everything else). How rows stay current: ``RowKV``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from scheduler_proc.cache.kv_pool import KVPool, attention_dtype, head_major_rows


@dataclass(frozen=True)
class RowKVPass:
    """What one decode pass's attention needs of the copy, for every layer: the new
    tokens' flat write positions and the ``[n * KH, width, D]`` blocks it reads."""

    k: torch.Tensor  # [layers, rows, KH, width, D], the copy itself
    v: torch.Tensor
    write_rows: (
        torch.Tensor
    )  # [n * KH] int64: (row * KH + head) * width + position of the new token
    n: int

    def append(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the new tokens' k and v ([n, KH, D]) into layer ``layer``'s copy, and
        returns that layer's keys and values as [n * KH, width, D] views."""
        keys, values = self.k[layer], self.v[layer]
        _, kh, width, d = keys.shape
        keys.view(-1, d).index_copy_(0, self.write_rows, k.reshape(-1, d).to(keys.dtype))
        values.view(-1, d).index_copy_(0, self.write_rows, v.reshape(-1, d).to(values.dtype))
        shape = (self.n * kh, width, d)
        return keys[: self.n].view(shape), values[: self.n].view(shape)


class NoRowKV:
    """No dense copy (``--decode-kv-rows off``, or a GPU by default): every decode pass reads
    the pool."""

    def prepare(
        self, joined: np.ndarray, seq_len: np.ndarray, kv_slot_table: torch.Tensor, width: int
    ) -> RowKVPass | None:
        return None


class RowKV:
    """Which rows are current is decided here, from two running-batch columns, not from the
    batch's membership events: row ``r`` holds the KV of the request whose join number
    (``RunningBatch.joined``, never reused by one batch) is ``owner[r]``, for its first
    ``filled[r]`` positions. A decode pass over rows with ``joined`` and ``seq_len`` trusts a
    row only when ``owner == joined`` and ``filled == seq_len - 1`` (all but the new token);
    any other row (a request that just joined, came back after a retraction, or moved rows
    in a swap-remove) is filled again from the pool first. A running request's slots are
    never rewritten while it runs (its prefix slots are the radix cache's, read-only; its
    own are its own), so a current row equals what the pool holds.

    The copy is exactly as wide as the pass reads (``width`` key columns), so its first
    ``n`` rows are one contiguous block: strided batches (a wider copy, read ``[:, :,
    :width]``) made the batched matmuls copy or crawl. When the width changes (every 16
    tokens the longest row grows, or when it leaves) the copy is laid out again, in place:
    its storage is reserved once at the budget's size (pages are committed as they are
    first written), and rows move block by block, through a staging copy only where a block
    overlaps its new place. A fresh tensor per layout instead had the kernel fault in every
    page again.

    Memory is bounded: the copy holds at most ``budget_tokens`` token positions (rows times
    columns). A pass that would need more reads the pool instead (``prepare`` returns None)
    and the copy is dropped; it is built again when a later pass fits.

    Columns past a row's length hold finite values (the pool's slot-0 padding, zeros, or an
    earlier column of its own): the decode pass weights them exactly 0, as it does the
    pool's padding slots, so a row's output is the same bits read either way
    (tests/unit/test_row_kv.py).

    The copy holds keys and values in the dtype attention reads them in
    (``attention_dtype``: float32 for a half-precision model), widened once as they are
    written, so no pass converts every row's keys again (in bfloat16 that cast was a
    quarter of a batch-256 decode forward); widening is exact, so the bits are the same."""

    def __init__(self, pool: KVPool, budget_tokens: int) -> None:
        if budget_tokens < 1:
            raise ValueError(f"RowKV: budget_tokens must be positive, got {budget_tokens}")
        self._pool = pool
        self._budget = budget_tokens
        self._layers, _, self._heads, self._dim = pool.k.shape
        self._dtype = attention_dtype(pool.k.dtype)
        # Flat storage of budget_tokens positions for every layer (None until a pass needs
        # it); the copy is its prefix viewed as [layers, rows, KH, width, D].
        self._storage: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rows = 0
        self._width = 0
        self._owner = np.zeros(0, dtype=np.int64)  # join number of each row's request; -1: none
        self._filled = np.zeros(0, dtype=np.int64)  # positions of each row that hold its KV

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, columns) of the copy now held; (0, 0) when none is."""
        return (self._rows, self._width)

    def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The copy's k and v, [layers, rows, KH, width, D], over its storage."""
        assert self._storage is not None
        shape = (self._layers, self._rows, self._heads, self._width, self._dim)
        size = self._layers * self._rows * self._heads * self._width * self._dim
        k, v = self._storage
        return k[:size].view(shape), v[:size].view(shape)

    def prepare(
        self, joined: np.ndarray, seq_len: np.ndarray, kv_slot_table: torch.Tensor, width: int
    ) -> RowKVPass | None:
        """Readies the copy for a decode pass over ``len(joined)`` rows, row ``r`` holding
        the request that joined as ``joined[r]``, with ``seq_len[r]`` tokens whose slots
        are ``kv_slot_table[r]`` (the last one's KV is the pass's to write), read over
        ``width`` key columns (at least the table's). Fills the rows that are not current
        from the pool. Returns None when the copy would exceed its budget: the pass then
        reads the pool."""
        n = len(joined)
        if not self._fit(n, width):
            return None
        k, v = self._views()
        stale = np.flatnonzero((self._owner[:n] != joined) | (self._filled[:n] != seq_len - 1))
        if stale.size:
            self._fill(k, v, stale, kv_slot_table)
            self._owner[stale] = joined[stale]
        self._filled[:n] = seq_len  # after the pass: its new token's column too
        heads = (
            np.arange(n, dtype=np.int64)[:, None] * self._heads + np.arange(self._heads)[None, :]
        )
        write_rows = (heads * width + (seq_len.astype(np.int64) - 1)[:, None]).reshape(-1)
        return RowKVPass(k, v, torch.from_numpy(write_rows).to(k.device), n)

    def _fit(self, n: int, width: int) -> bool:
        """Makes the copy exactly ``width`` columns and at least ``n`` rows, within the
        budget; False (and no copy held) when that cannot be."""
        if n <= self._rows and width == self._width:
            return True
        if n * width > self._budget:
            self.drop()
            return False
        if self._storage is None:
            # empty: pages are committed as rows are written (a row is filled before any
            # pass reads it), so an unused budget costs address space, not memory.
            size = self._layers * self._budget * self._heads * self._dim
            self._storage = (
                torch.empty(size, dtype=self._dtype, device=self._pool.k.device),
                torch.empty(size, dtype=self._dtype, device=self._pool.k.device),
            )
        # Rows double as the batch grows, so that a growing batch lays the copy out again
        # only now and then; within the budget.
        want = self._rows if n <= self._rows else max(n, 2 * self._rows)
        self._relayout(want if want * width <= self._budget else n, width, n)
        return True

    def _relayout(self, rows: int, width: int, keep: int) -> None:
        """The copy as ``rows`` rows by ``width`` columns, in place, keeping the first
        ``keep`` rows (the current pass's), each cut or padded with zeros to ``width``
        (uninitialised memory could hold NaN, and 0 * NaN is NaN)."""
        kept, cols = min(keep, rows, self._rows), min(width, self._width)
        if kept:
            for store in self._storage or ():
                _move_rows(
                    store,
                    (self._layers, self._rows, self._heads, self._width, self._dim),
                    rows,
                    width,
                    kept,
                )
        owner = np.full(rows, -1, dtype=np.int64)
        filled = np.zeros(rows, dtype=np.int64)
        # A row cut shorter than its KV is not current any more.
        owner[:kept] = np.where(self._filled[:kept] <= cols, self._owner[:kept], -1)
        filled[:kept] = self._filled[:kept]
        self._rows, self._width, self._owner, self._filled = rows, width, owner, filled

    def drop(self) -> None:
        """Frees the copy; the next pass that fits builds it again from the pool."""
        self._storage = None
        self._rows = self._width = 0
        self._owner = np.zeros(0, dtype=np.int64)
        self._filled = np.zeros(0, dtype=np.int64)

    def _fill(
        self, k: torch.Tensor, v: torch.Tensor, stale: np.ndarray, kv_slot_table: torch.Tensor
    ) -> None:
        """Rows ``stale`` of the copy (``k`` and ``v``, [layers, rows, KH, width, D]) from
        the pool, every column: the table's (the new token's slot too; the pass overwrites
        that column), then slot 0, finite by the KVPool invariant, as the pool path pads."""
        device, width = k.device, k.shape[3]
        table = kv_slot_table.index_select(0, torch.from_numpy(stale).to(kv_slot_table.device)).to(
            device
        )
        reads = head_major_rows(table, self._heads, width)
        rows = torch.from_numpy(stale).to(device)
        for layer in range(self._layers):
            for pool, copy in ((self._pool.k[layer], k[layer]), (self._pool.v[layer], v[layer])):
                copy[rows] = (
                    pool.view(-1, self._dim)
                    .index_select(0, reads)
                    .view(len(stale), self._heads, width, self._dim)
                    .to(copy.dtype)
                )


# Rows moved per staging copy: a few MB at most for any model this runs on a CPU.
_MOVE_BLOCK_BYTES = 4 << 20


def _move_rows(
    store: torch.Tensor, old: tuple[int, int, int, int, int], rows: int, width: int, kept: int
) -> None:
    """Rewrites the flat ``store``, laid out as ``old`` = (layers, old rows, KH, old width,
    D), as (layers, ``rows``, KH, ``width``, D), keeping rows ``[0, kept)`` of each layer
    (cut or zero-padded to ``width``). Blocks of rows go through a staging copy, in the
    order in which no block's new place overwrites a block not yet moved: from the end
    when the rows move up (a wider or longer layout), from the start when they move down.
    Only a block that overlaps its own new place (those near the start) needs the staging."""
    layers, old_rows, heads, old_width, dim = old
    old_row, new_row = heads * old_width * dim, heads * width * dim  # elements per row
    cols = min(width, old_width)
    per_block = max(1, _MOVE_BLOCK_BYTES // (store.element_size() * max(old_row, new_row)))
    blocks = [
        (layer, start, min(start + per_block, kept))
        for layer in range(layers)
        for start in range(0, kept, per_block)
    ]
    # A row's shift, (layer * rows + r) * new_row - (layer * old_rows + r) * old_row, has
    # one sign for every row when rows and width both grow or both shrink; otherwise the
    # layout goes through a whole staging copy.
    up, down = (
        rows * new_row >= old_rows * old_row and new_row >= old_row,
        rows * new_row <= old_rows * old_row and new_row <= old_row,
    )
    if not (up or down):
        staged = (
            store[: layers * old_rows * old_row]
            .view(layers, old_rows, heads, old_width, dim)[:, :kept]
            .clone()
        )
        target = store[: layers * rows * new_row].view(layers, rows, heads, width, dim)
        target[:, :kept, :, :cols] = staged[..., :cols, :]
        target[:, :kept, :, cols:] = 0
        return
    for layer, a, b in reversed(blocks) if up else blocks:
        src_start, src_end = (layer * old_rows + a) * old_row, (layer * old_rows + b) * old_row
        dst_start, dst_end = (layer * rows + a) * new_row, (layer * rows + b) * new_row
        src = store[src_start:src_end].view(b - a, heads, old_width, dim)[:, :, :cols]
        if dst_start < src_end and src_start < dst_end:  # the block overlaps its new place
            src = src.clone()
        dst = store[dst_start:dst_end].view(b - a, heads, width, dim)
        dst[:, :, :cols] = src
        dst[:, :, cols:] = 0
