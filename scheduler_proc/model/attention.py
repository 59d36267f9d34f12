"""Attention over the token-level KV pool for one layer of one batched pass.

The decoder layer projects and rotates q, k and v; this module writes the new keys and
values into the pool and attends each new token over its sequence's keys, read through
``AttentionLayout.kv_slot_table``. It is the one place that knows how keys are read back, so
a faster kernel replaces this module and nothing else."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from scheduler_proc.batch.forward_batch import AttentionLayout


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
    # Write before gathering, so each sequence's new keys are read back with its prefix.
    k_cache.index_copy_(0, layout.out_slots, k)
    v_cache.index_copy_(0, layout.out_slots, v)
    keys = _gather(k_cache, layout.kv_slot_table)  # [B, KH, L, D]
    values = _gather(v_cache, layout.kv_slot_table)
    queries = layout.pad(q).transpose(1, 2)  # [B, H, Qmax, D]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=layout.mask, enable_gqa=True, scale=scale)
    return layout.unpad(out.transpose(1, 2))  # [T, H, D]


def _gather(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    # index_select over flat rows, not cache[table]: the gather is the biggest cost of a
    # large decode step, and advanced indexing is ~4x slower at it on the CPU.
    b, length = table.shape
    return cache.index_select(0, table.reshape(-1)).view(b, length, *cache.shape[1:]).transpose(1, 2)
