"""Attention over the token-level KV pool for one layer of one batched pass.

The decoder layer projects and rotates q, k and v; this module writes the new keys and
values into the pool and attends each new token over its sequence's keys, read through
``AttentionLayout.kv_slot_table``. It is the one place that knows how keys are read back, so
a faster kernel replaces this module and nothing else.

Two paths, chosen by the pass's shape (``AttentionLayout.is_decode``), never by the rows in
it, so a row's output does not depend on its neighbours' kind:

- decode (one new token per sequence, causal): ``decode_attention`` gathers each row's keys
  head-major, straight into the [B * KH, L, D] block that ``bmm`` reads, and attends with
  two batched matmuls and a softmax. At batch 256 and ~60 keys on one CPU thread a layer
  takes ~4 ms instead of ~6.5 (SDPA reorders the gathered keys and expands them for GQA);
  two thirds of what is left are the two gathers, random reads of the pool.
- everything else (prefill chunks, mixed lengths, dLLM blocks): ``padded_attention``, one
  masked SDPA call over queries padded to [B, Qmax].

Both read padded key columns (slot 0, finite by the KVPool invariant) and weight them 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from scheduler_proc.batch.forward_batch import AttentionLayout, DecodeReads


def pool_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: AttentionLayout,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D], k and v [T, KH, D] of the new tokens; k_cache and v_cache one layer's
    pool [slots, KH, D]. Returns the attention output [T, H, D]."""
    if layout.is_decode:
        return decode_attention(q, k, v, layout.decode_reads(k_cache.shape[1]), k_cache, v_cache, scale, layout.out_slots)
    return padded_attention(q, k, v, layout, k_cache, v_cache, scale)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    reads: DecodeReads,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    out_slots: torch.Tensor,
) -> torch.Tensor:
    """One new token per sequence: q [B, H, D], k and v [B, KH, D]. Returns [B, H, D]."""
    b, h, d = q.shape
    kh = k_cache.shape[1]
    # Write before gathering, so each sequence's new key is read back with its prefix.
    k_cache.index_copy_(0, out_slots, k)
    v_cache.index_copy_(0, out_slots, v)
    # view, not reshape: a non-contiguous layer slice would make reshape copy the whole pool.
    keys = k_cache.view(-1, d).index_select(0, reads.rows).view(b * kh, -1, d)  # [B*KH, L, D]
    values = v_cache.view(-1, d).index_select(0, reads.rows).view(b * kh, -1, d)
    # Query head i reads kv head i // G (SDPA's enable_gqa, HF's repeat_kv): the G query
    # heads of a kv head are adjacent, so [B, H, D] is [B*KH, G, D] without a copy.
    # Half-precision models attend in float32, as SDPA's kernels do (scores, softmax and the
    # weighted sum never rounded to 16 bits): a bfloat16 bmm would round every score, and
    # greedy tokens would leave transformers' at many more near ties. No-op casts in float32.
    wide = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
    queries = q.reshape(b * kh, h // kh, d).to(wide)
    scores = torch.baddbmm(reads.bias.to(wide), queries, keys.to(wide).transpose(1, 2), alpha=scale)
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs, values.to(wide)).to(q.dtype).view(b, h, d)


def padded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: AttentionLayout,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The general path: any new lengths, causal or dLLM-bidirectional. Same arguments and
    result as ``pool_attention``."""
    # Write before gathering, so each sequence's new keys are read back with its prefix.
    k_cache.index_copy_(0, layout.out_slots, k)
    v_cache.index_copy_(0, layout.out_slots, v)
    keys = _gather(k_cache, layout.kv_slot_table)  # [B, KH, L, D]
    values = _gather(v_cache, layout.kv_slot_table)
    queries = layout.pad(q).transpose(1, 2)  # [B, H, Qmax, D]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=layout.mask, enable_gqa=True, scale=scale)
    return layout.unpad(out.transpose(1, 2))  # [T, H, D]


def _gather(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    # index_select over flat rows, not cache[table]: advanced indexing is ~4x slower at it
    # on the CPU.
    b, length = table.shape
    return cache.index_select(0, table.reshape(-1)).view(b, length, *cache.shape[1:]).transpose(1, 2)
