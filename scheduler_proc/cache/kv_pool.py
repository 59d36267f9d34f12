"""Token-level KV cache pool: one slot holds one token's K and V for every layer.

Invariants:
- Slot bookkeeping (the free stack) lives on the host, whatever the KV device is: the
  scheduler decides admissions on the host, and a device-side stack would cost a device
  sync per alloc on CUDA. Returned slot tensors are CPU int64; ForwardBatch moves them.
- alloc/free are O(1) Python calls plus one tensor copy, never a per-slot loop.
- Freed slots keep their old (finite) contents; that is what makes reading a padded slot
  harmless (see LlamaForCausalLM.forward).
"""

from __future__ import annotations

import torch


def attention_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attention reads keys and values in: float32 for a half-precision model (the
    scores, softmax and weighted sum are never rounded to 16 bits, as in SDPA's kernels),
    else the model's own. Widening a 16-bit value to float32 is exact."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


class KVPool:
    def __init__(
        self,
        num_layers: int,
        capacity: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        debug: bool = False,
        pin_memory: bool = False,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"KVPool capacity must be positive, got {capacity}")
        shape = (num_layers, capacity, num_kv_heads, head_dim)
        # zeros, not empty: attention reads padded slots (masked out, weight 0), and
        # 0 * NaN from uninitialised memory would still poison the output.
        # pin_memory: a host pool (HiCache) whose copies to and from a GPU can overlap.
        self.k = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
        self.v = torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
        self._capacity = capacity
        # Stack of free slots in [0, _top); reversed so the first allocs get low slots.
        self._free = torch.arange(capacity - 1, -1, -1, dtype=torch.long)
        self._top = capacity
        # Per-slot ownership is only tracked when asked for: it costs a scatter per call.
        self._in_use: torch.Tensor | None = (
            torch.zeros(capacity, dtype=torch.bool) if debug else None
        )

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self._capacity - self._top

    def alloc(self, n: int) -> torch.Tensor | None:
        """n distinct free slots (CPU int64), or None if fewer than n are free.
        Never a partial allocation, so the caller can retract and retry cleanly."""
        if n < 0:
            raise ValueError(f"alloc size must be >= 0, got {n}")
        if n > self._top:
            return None
        self._top -= n
        # flip() both orders the slots ascending and copies them out of the stack.
        slots = self._free[self._top : self._top + n].flip(0)
        if self._in_use is not None:
            assert not bool(self._in_use[slots].any()), "KVPool: allocated a slot in use"
            self._in_use[slots] = True
        return slots

    def free(self, slots: torch.Tensor) -> None:
        slots = slots.reshape(-1).to(device="cpu", dtype=torch.long)
        n = slots.numel()
        # The only check cheap enough for the hot path: more frees than allocs.
        if self._top + n > self._capacity:
            raise RuntimeError(
                f"KVPool.free: freeing {n} slots with only {self.num_used} in use (double free)"
            )
        if self._in_use is not None:
            assert slots.unique().numel() == n, "KVPool.free: duplicate slots in one call"
            assert bool(self._in_use[slots].all()), (
                "KVPool.free: slot freed twice or never allocated"
            )
            self._in_use[slots] = False
        self._free[self._top : self._top + n] = slots
        self._top += n


def head_major_rows(slot_table: torch.Tensor, num_kv_heads: int, columns: int) -> torch.Tensor:
    """Where a layer's pool ``[slots, KH, D]``, viewed as ``[slots * KH, D]``, holds the keys
    of ``slot_table`` ([B, L] slots), in (row, kv head, column) order: one ``index_select``
    of them is the ``[B * KH, columns, D]`` block a decode pass attends over. Columns past L
    read slot 0, finite by the pool's invariant (the pass weights them 0)."""
    table = torch.nn.functional.pad(slot_table, (0, columns - slot_table.shape[1]))
    heads = torch.arange(num_kv_heads, device=table.device).view(1, num_kv_heads, 1)
    return (table.unsqueeze(1) * num_kv_heads + heads).reshape(-1)
