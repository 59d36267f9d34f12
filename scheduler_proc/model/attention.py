"""Attention over the token-level KV pool for one layer of one batched pass.

The decoder layer projects and rotates q, k and v; this module writes the new keys and
values into the pool and attends each new token over its sequence's keys, read through
``AttentionLayout.kv_slot_table``. It is the one place that knows how keys are read back, so
a faster kernel replaces this module and nothing else.

Two paths (``pool_attention``), chosen by the pass's shape (``AttentionLayout.is_decode``),
never by the rows in it, so a row's output does not depend on its neighbours' kind; with
``--enable-deterministic-inference`` a third serves every other causal pass, attending each
query as a decode step. All read padded key columns (finite: the KVPool's and RowKV's
invariant) and weight them 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from scheduler_proc.cache.kv_pool import attention_dtype
from scheduler_proc.model import batch_invariant
from scheduler_proc.model.forward_batch import AttentionLayout


def pool_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: AttentionLayout,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    layer: int,
) -> torch.Tensor:
    """q [T, H, D], k and v [T, KH, D] of the new tokens; k_cache and v_cache one layer's
    pool [slots, KH, D], that of layer ``layer``. Returns the attention output [T, H, D].

    - decode (one new token per sequence, causal): ``decode_attention`` attends over each
      row's keys as a head-major [B * KH, L, D] block with two batched matmuls and a softmax
      (SDPA would reorder the keys and expand them for GQA). The block is a view of the
      running batch's dense KV copy (``scheduler_proc.cache.row_kv``) when the pass has one,
      else it is gathered from the pool head-major, straight into that shape (random reads
      of the pool: a large share of a big decode step on the CPU, which the copy saves).
    - with ``layout.per_query`` (deterministic inference), every other causal pass:
      ``per_query_attention``, each new token as a decode step over its own keys.
    - everything else (prefill chunks, mixed lengths, dLLM blocks): ``padded_attention``,
      one masked SDPA call over queries padded to [B, Qmax]."""
    if layout.per_query:
        return per_query_attention(q, k, v, layout, k_cache, v_cache, scale)
    if not layout.is_decode:
        return padded_attention(q, k, v, layout, k_cache, v_cache, scale)
    reads = layout.decode_reads(k_cache.shape[1])
    # The pool stays the truth (the prefix cache, retraction and PD read it); write before
    # reading, so each sequence's new key is read back with its prefix.
    k_cache.index_copy_(0, layout.out_slots, k)
    v_cache.index_copy_(0, layout.out_slots, v)
    if layout.row_kv is not None:
        keys, values = layout.row_kv.append(layer, k, v)
    else:
        assert reads.rows is not None, "a decode pass without a KV copy has its gather rows"
        b, kh, d = k.shape
        # view, not reshape: a non-contiguous layer slice would make reshape copy the whole pool.
        keys = k_cache.view(-1, d).index_select(0, reads.rows).view(b * kh, -1, d)  # [B*KH, L, D]
        values = v_cache.view(-1, d).index_select(0, reads.rows).view(b * kh, -1, d)
    return decode_attention(q, keys, values, reads.bias, scale, layout.deterministic)


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    deterministic: bool = False,
) -> torch.Tensor:
    """One new token per sequence: q [B, H, D]; keys and values [B * KH, L, D], sequence b's
    kv head h at b * KH + h; bias [B * KH, 1, L] (-inf on padded columns). Returns [B, H, D].
    ``deterministic``: the weighted sum adds up key block by key block
    (``batch_invariant.weighted_values``), so L does not change a row's bits."""
    b, h, d = q.shape
    kh = keys.shape[0] // b
    # Query head i reads kv head i // G (SDPA's enable_gqa, HF's repeat_kv): the G query
    # heads of a kv head are adjacent, so [B, H, D] is [B*KH, G, D] without a copy.
    # Half-precision models attend in float32, as SDPA's kernels do (scores, softmax and the
    # weighted sum never rounded to 16 bits): a bfloat16 bmm would round every score, and
    # greedy tokens would leave transformers' at many more near ties. No-op casts in float32.
    wide = attention_dtype(q.dtype)
    queries = q.reshape(b * kh, h // kh, d).to(wide)
    scores = torch.baddbmm(bias.to(wide), queries, keys.to(wide).transpose(1, 2), alpha=scale)
    probs = torch.softmax(scores, dim=-1)
    if deterministic:
        out = batch_invariant.weighted_values(probs, values.to(wide))
    else:
        out = torch.bmm(probs, values.to(wide))
    return out.to(q.dtype).view(b, h, d)


def per_query_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: AttentionLayout,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Any causal pass, each new token attending as a decode step does: its G query heads of a
    kv head against that head's keys, one batched product per token (``decode_attention``),
    so a token's output is the same bits in a whole prefill, a chunk, a cached prompt's last
    position and a decode step. Same arguments and result as ``pool_attention``."""
    k_cache.index_copy_(0, layout.out_slots, k)
    v_cache.index_copy_(0, layout.out_slots, v)
    t, h, d = q.shape
    kh = k_cache.shape[1]
    reads = layout.query_reads(kh)
    # Widened once here: decode_attention's casts are then no-ops, never copies per token.
    wide = attention_dtype(q.dtype)
    keys = k_cache.view(-1, d).index_select(0, reads.rows).view(-1, kh, reads.bias.shape[-1], d)
    values = v_cache.view(-1, d).index_select(0, reads.rows).view(keys.shape)
    keys, values = keys.to(wide), values.to(wide)
    out = torch.empty_like(q)
    g = h // kh
    for b, (start, n) in enumerate(reads.spans):
        tokens = slice(start, start + n)
        queries = q[tokens].view(n, kh, g, d)
        # Every token of the sequence reads the same keys: a stride-0 batch, no copy.
        shape = (n, *keys.shape[2:])
        for head in range(kh):
            out[tokens, head * g : (head + 1) * g] = decode_attention(
                queries[:, head],
                keys[b, head].expand(shape),
                values[b, head].expand(shape),
                reads.bias[tokens],
                scale,
                deterministic=True,
            )
    return out


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
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=layout.mask, enable_gqa=True, scale=scale
    )
    return layout.unpad(out.transpose(1, 2))  # [T, H, D]


def _gather(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    # index_select over flat rows, not cache[table]: advanced indexing is ~4x slower at it
    # on the CPU.
    b, length = table.shape
    return (
        cache.index_select(0, table.reshape(-1)).view(b, length, *cache.shape[1:]).transpose(1, 2)
    )
