"""The tensors of one batched model pass, in the layout LlamaForCausalLM.forward reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from scheduler_proc.cache.kv_pool import head_major_rows
from scheduler_proc.cache.row_kv import RowKVPass
from scheduler_proc.model.batch_invariant import KEY_BLOCK, key_columns


@dataclass
class ForwardBatch:
    """One batched 'extend' pass: each sequence b already has prefix_lens[b] tokens in the
    KV pool and appends new_lens[b] tokens. Decode is new_lens == 1.

    Invariant: kv_slot_table[b, j] is the pool slot of the token at position j of sequence
    b, so a key's column index is its position.
    """

    input_ids: torch.Tensor  # [T] int64, the new tokens of all sequences, concatenated
    positions: torch.Tensor  # [T] int64, absolute positions (prefix_len + i)
    new_lens: torch.Tensor  # [B] int64
    out_slots: torch.Tensor  # [T] int64, pool slots where the new tokens' K/V are written
    kv_slot_table: torch.Tensor  # [B, Lmax] int64, padded with 0 (masked out)
    kv_lens: torch.Tensor  # [B] int64, prefix_lens + new_lens
    # dLLM refinement: a new token at position >= bidirectional_from[b] attends to every
    # token of its sequence (the block sees itself both ways); earlier ones stay causal.
    # None: every sequence is causal (prefill, decode).
    bidirectional_from: torch.Tensor | None = None  # [B] int64
    # A decode pass that reads the running batch's dense KV copy (scheduler_proc.cache.row_kv)
    # rather than gathering from the pool; None: it reads the pool.
    row_kv: RowKVPass | None = None

    @property
    def batch_size(self) -> int:
        return self.new_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @classmethod
    def build(
        cls,
        new_token_ids: list[list[int]],
        prefix_slots: list[torch.Tensor],
        new_slots: list[torch.Tensor],
        device: torch.device | str,
        bidirectional_from: list[int] | None = None,
    ) -> ForwardBatch:
        """Assemble on the host, then copy each tensor to `device` once."""
        if not (len(new_token_ids) == len(prefix_slots) == len(new_slots)):
            raise ValueError(
                f"ForwardBatch.build: got {len(new_token_ids)} token lists, "
                f"{len(prefix_slots)} prefix slot tensors and {len(new_slots)} new slot tensors"
            )
        if not new_token_ids:
            raise ValueError("ForwardBatch.build: empty batch")
        new_lens = torch.tensor([len(ids) for ids in new_token_ids], dtype=torch.long)
        prefix_lens = torch.tensor([s.numel() for s in prefix_slots], dtype=torch.long)
        if bool((new_lens == 0).any()):
            raise ValueError("ForwardBatch.build: every sequence needs at least one new token")
        new_slot_lens = torch.tensor([s.numel() for s in new_slots], dtype=torch.long)
        if not torch.equal(new_slot_lens, new_lens):
            raise ValueError(
                f"ForwardBatch.build: new_slots lengths {new_slot_lens.tolist()} do not match "
                f"new token counts {new_lens.tolist()}"
            )
        kv_lens = prefix_lens + new_lens
        batch_size, max_kv_len = len(new_token_ids), int(kv_lens.max())

        input_ids = torch.tensor([t for ids in new_token_ids for t in ids], dtype=torch.long)
        out_slots = _cat_cpu(new_slots)
        positions = new_positions(prefix_lens, new_lens)

        # Each row is prefix slots then new slots, left-aligned: fill through a mask so
        # the whole table is one scatter.
        per_seq = [t for pair in zip(prefix_slots, new_slots) for t in pair]
        kv_slot_table = torch.zeros((batch_size, max_kv_len), dtype=torch.long)
        valid = torch.arange(max_kv_len) < kv_lens[:, None]
        kv_slot_table[valid] = _cat_cpu(per_seq)

        return cls(
            input_ids=input_ids.to(device),
            positions=positions.to(device),
            new_lens=new_lens.to(device),
            out_slots=out_slots.to(device),
            kv_slot_table=kv_slot_table.to(device),
            kv_lens=kv_lens.to(device),
            bidirectional_from=(
                None
                if bidirectional_from is None
                else torch.tensor(bidirectional_from, dtype=torch.long).to(device)
            ),
        )

    @classmethod
    def verify(
        cls,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        new_lens: torch.Tensor,
        out_slots: torch.Tensor,
        kv_slot_table: torch.Tensor,
        kv_lens: torch.Tensor,
        device: torch.device | str,
    ) -> ForwardBatch:
        """A speculative verify pass from the running batch's columns: sequence b's
        ``new_lens[b]`` new tokens (its last, then its drafts), at ``positions`` and writing
        their KV to ``out_slots`` (both laid out as ``new_positions``'), end its
        ``kv_lens[b]`` tokens, whose slots (the drafts' too) are in ``kv_slot_table``, a slice
        of the request-to-token table. Column work, as ``decode``."""
        return cls(
            input_ids=input_ids.to(device),
            positions=positions.to(device),
            new_lens=new_lens.to(device),
            out_slots=out_slots.to(device),
            kv_slot_table=kv_slot_table.to(device),
            kv_lens=kv_lens.to(device),
        )

    @classmethod
    def decode(
        cls,
        last_tokens: torch.Tensor,
        seq_lens: torch.Tensor,
        kv_slot_table: torch.Tensor,
        device: torch.device | str,
        row_kv: RowKVPass | None = None,
    ) -> ForwardBatch:
        """A decode pass from the running batch's columns: one new token per sequence (its
        last), whose KV slot is already in ``kv_slot_table`` at column ``seq_lens - 1``.
        Nothing here is per sequence: the table is a slice of the request-to-token table."""
        positions = seq_lens - 1
        out_slots = kv_slot_table.gather(1, positions.unsqueeze(1)).squeeze(1)
        return cls(
            input_ids=last_tokens.to(device),
            positions=positions.to(device),
            new_lens=torch.ones_like(seq_lens).to(device),
            out_slots=out_slots.to(device),
            kv_slot_table=kv_slot_table.to(device),
            kv_lens=seq_lens.to(device),
            row_kv=row_kv,
        )


def new_positions(prefix_lens: torch.Tensor, new_lens: torch.Tensor) -> torch.Tensor:
    """The position of each new token: new token i of sequence b is at prefix_lens[b] + i,
    as a column op."""
    starts = torch.cumsum(new_lens, 0) - new_lens
    offset = torch.repeat_interleave(prefix_lens - starts, new_lens)
    return torch.arange(int(new_lens.sum()), dtype=torch.long) + offset


def _cat_cpu(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One CPU int64 tensor of all the slots. Slot tensors are 1-D CPU int64 already (a
    KVPool invariant), so one ``cat`` does it (converting each tensor first was most of a
    large step's build). Anything else takes the slow path."""
    try:
        out = torch.cat(tensors)
    except RuntimeError:  # a 0-d or foreign-device tensor
        return torch.cat([t.reshape(-1).to(device="cpu", dtype=torch.long) for t in tensors])
    return out.to(device="cpu", dtype=torch.long)


# A decode pass reads each row's keys padded to a multiple of this many columns. Without it
# a row's scores and softmax change in the last bit with the batch's longest row: the CPU
# kernels (a gemm's edge tiles, softmax's vector tail) take a different path for the last
# width % 16 columns. Aligned, the padding adds only exact zeros to the scores and softmax,
# and for the built-in model's shapes to the weighted sum too (tests/unit/test_attention.py);
# at other shapes the weighted sum's matmul splits its sum by the width (4 query heads of 128:
# 200 to 368 columns), which deterministic inference's key blocks avoid (KEY_BLOCK). It costs
# at most 15 padded columns.
DECODE_KEY_ALIGN = 16


def key_align(deterministic: bool) -> int:
    """What a decode (or per-query) pass pads its key columns to a multiple of: with
    ``--enable-deterministic-inference`` the key block its weighted sum adds up by."""
    return KEY_BLOCK if deterministic else DECODE_KEY_ALIGN


def decode_key_columns(max_kv_len: int, align: int = DECODE_KEY_ALIGN) -> int:
    """The key columns a decode pass reads when its longest sequence has ``max_kv_len``."""
    return key_columns(max_kv_len, align)


@dataclass(frozen=True)
class DecodeReads:
    """How a decode pass reads one layer's keys head-major. From the pool: the pool
    [slots, KH, D] viewed as [slots * KH, D] has sequence b's keys of kv head h at rows
    ``slot * KH + h``, so one ``index_select`` of ``rows`` yields the [B * KH, L, D] block the
    batched matmuls read, with no copy to reorder it. From the running batch's dense copy
    (``AttentionLayout.row_kv``): views of it, no gather, and no ``rows``."""

    rows: (
        torch.Tensor | None
    )  # [B * KH * L] int64, in (b, h, column) order; None: the pass reads row_kv
    bias: torch.Tensor  # [B * KH, 1, L] model dtype: 0 on a key, -inf on a padded column


@dataclass(frozen=True)
class QueryReads:
    """How a per-query pass (``AttentionLayout.per_query``) reads one layer's keys: the
    head-major block a decode pass gathers from the pool, and each new token's bias over it,
    so that every token attends as it would as a decode step."""

    num_kv_heads: int
    rows: torch.Tensor  # [B * KH * L] int64, in (b, h, column) order
    bias: torch.Tensor  # [T, 1, L] model dtype: 0 on the token's keys (its position and before)
    spans: list[tuple[int, int]]  # per sequence: its first new token's row, its new tokens


@dataclass
class AttentionLayout:
    """Per-pass view of a ForwardBatch for attention, computed once and shared by every layer.

    Queries are padded to [B, Qmax] so a single SDPA call covers the batch. A padded query
    gets position 0, so its mask row still allows key 0: an all-masked row would make SDPA
    return NaN. Its output is dropped by unpad().

    A decode pass (``is_decode``: one new token per sequence, all causal) is read head-major
    instead (``decode_reads``); its key columns past ``kv_lens[b]`` are padding. With
    ``deterministic`` every other causal pass is read so too (``per_query``, ``query_reads``):
    each new token attends as a decode step of its own.
    """

    cos: torch.Tensor  # [T, 1, D] rotary rows of the new tokens, model dtype
    sin: torch.Tensor  # [T, 1, D]
    out_slots: torch.Tensor  # [T]
    kv_slot_table: torch.Tensor  # [B, Lmax]
    kv_lens: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, 1, Qmax, Lmax] bool, True = may attend
    batch_size: int
    max_new_len: int
    pad_index: torch.Tensor | None  # [T] row in the flattened [B * Qmax]; None = no padding
    is_decode: bool
    row_kv: RowKVPass | None  # the decode pass's dense KV copy, or None: gather from the pool
    positions: torch.Tensor  # [T] the new tokens' positions
    new_lens: torch.Tensor  # [B]
    causal: bool  # False: a dLLM pass, whose blocks attend both ways
    deterministic: bool  # --enable-deterministic-inference: per_query passes, key blocks
    # decode_reads' result for the one kv head count a model has: built by the first layer,
    # read by the rest (the head count is the pool's, which from_batch does not see).
    _decode_reads: DecodeReads | None = field(default=None, init=False, repr=False)
    _query_reads: QueryReads | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_batch(
        cls,
        batch: ForwardBatch,
        cos_cache: torch.Tensor,
        sin_cache: torch.Tensor,
        dtype: torch.dtype,
        *,
        deterministic: bool = False,
    ) -> AttentionLayout:
        b, t = batch.batch_size, batch.num_tokens
        device = batch.input_ids.device
        max_new = int(batch.new_lens.max())  # the pass's one host sync
        if t == b * max_new:
            # Every sequence has max_new new tokens (decode, or equal chunks): the
            # concatenation already is the padded block.
            pad_index = None
            q_pos = batch.positions.view(b, max_new)
        else:
            seq = torch.repeat_interleave(
                torch.arange(b, device=device), batch.new_lens, output_size=t
            )
            starts = torch.cumsum(batch.new_lens, 0) - batch.new_lens
            pad_index = seq * max_new + (torch.arange(t, device=device) - starts[seq])
            q_pos = torch.zeros(b * max_new, dtype=torch.long, device=device)
            q_pos[pad_index] = batch.positions
            q_pos = q_pos.view(b, max_new)
        # Column j of kv_slot_table holds position j, so causality is a position compare;
        # columns past kv_lens[b] are beyond every real query's position and drop out too.
        key_pos = torch.arange(batch.kv_slot_table.shape[1], device=device)
        mask = key_pos.view(1, 1, 1, -1) <= q_pos.view(b, 1, max_new, 1)
        if batch.bidirectional_from is not None:
            # A padded query has position 0, below every bidirectional_from (prompts are
            # never empty), so its row stays causal and keeps key 0.
            both_ways = (q_pos >= batch.bidirectional_from.view(b, 1)).view(b, 1, max_new, 1)
            mask = mask | (both_ways & (key_pos.view(1, 1, 1, -1) < batch.kv_lens.view(b, 1, 1, 1)))
        return cls(
            cos=cos_cache[batch.positions].to(dtype).unsqueeze(1),
            sin=sin_cache[batch.positions].to(dtype).unsqueeze(1),
            out_slots=batch.out_slots,
            kv_slot_table=batch.kv_slot_table,
            kv_lens=batch.kv_lens,
            mask=mask,
            batch_size=b,
            max_new_len=max_new,
            pad_index=pad_index,
            is_decode=max_new == 1 and batch.bidirectional_from is None,
            row_kv=batch.row_kv,
            positions=batch.positions,
            new_lens=batch.new_lens,
            causal=batch.bidirectional_from is None,
            deterministic=deterministic,
        )

    @property
    def per_query(self) -> bool:
        """Whether this pass attends query by query, as decode steps do (``query_reads``):
        with ``deterministic``, every causal pass that is not a decode pass."""
        return self.deterministic and self.causal and not self.is_decode

    @property
    def key_align(self) -> int:
        return key_align(self.deterministic)

    def decode_reads(self, num_kv_heads: int) -> DecodeReads:
        """The head-major rows and padding bias of a decode pass, for pools of
        ``num_kv_heads`` heads; built once per pass."""
        if not self.is_decode:
            raise ValueError(
                "AttentionLayout.decode_reads: not a decode pass"
                " (one causal new token per sequence)"
            )
        reads = self._decode_reads
        if reads is None or reads.bias.shape[0] != self.batch_size * num_kv_heads:
            reads = self._decode_reads = self._build_decode_reads(num_kv_heads)
        return reads

    def _build_decode_reads(self, num_kv_heads: int) -> DecodeReads:
        table = self.kv_slot_table
        b, width = table.shape
        # Key columns padded to a multiple of key_align (weight 0): see DECODE_KEY_ALIGN.
        length = decode_key_columns(width, self.key_align)
        rows = head_major_rows(table, num_kv_heads, length) if self.row_kv is None else None
        # The new token is the last of its sequence, so causality is just "a key exists".
        padded = torch.arange(length, device=table.device).view(1, length) >= self.kv_lens.view(
            b, 1
        )
        bias = torch.zeros((b, length), dtype=self.cos.dtype, device=table.device).masked_fill_(
            padded, float("-inf")
        )
        bias = (
            bias.view(b, 1, 1, length)
            .expand(b, num_kv_heads, 1, length)
            .reshape(b * num_kv_heads, 1, length)
        )
        return DecodeReads(rows=rows, bias=bias)

    def query_reads(self, num_kv_heads: int) -> QueryReads:
        """The head-major rows, per-token bias and spans of a per-query pass, for pools of
        ``num_kv_heads`` heads; built once per pass."""
        if not self.per_query:
            raise ValueError("AttentionLayout.query_reads: not a per-query pass")
        reads = self._query_reads
        if reads is None or reads.num_kv_heads != num_kv_heads:
            reads = self._query_reads = self._build_query_reads(num_kv_heads)
        return reads

    def _build_query_reads(self, num_kv_heads: int) -> QueryReads:
        table = self.kv_slot_table
        length = decode_key_columns(table.shape[1], self.key_align)
        rows = head_major_rows(table, num_kv_heads, length)
        # A token sees its sequence's keys up to its own position: causal, and every column
        # past kv_lens[b] lies beyond it.
        key_pos = torch.arange(length, device=table.device).view(1, length)
        later = key_pos > self.positions.view(-1, 1)
        bias = torch.zeros(later.shape, dtype=self.cos.dtype, device=table.device)
        bias = bias.masked_fill_(later, float("-inf")).unsqueeze(1)
        lens = self.new_lens.tolist()  # a host sync, once per pass (prefill only)
        starts = accumulate(lens[:-1], initial=0)
        return QueryReads(num_kv_heads, rows, bias, list(zip(starts, lens)))

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B, Qmax, ...]"""
        if self.pad_index is None:
            return x.view(self.batch_size, self.max_new_len, *x.shape[1:])
        out = x.new_zeros((self.batch_size * self.max_new_len, *x.shape[1:]))
        out[self.pad_index] = x
        return out.view(self.batch_size, self.max_new_len, *x.shape[1:])

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Qmax, ...] -> [T, ...]"""
        flat = x.reshape(self.batch_size * self.max_new_len, *x.shape[2:])
        return flat if self.pad_index is None else flat[self.pad_index]
