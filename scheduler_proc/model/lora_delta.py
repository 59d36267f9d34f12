"""The LoRA delta of one pass, for all rows of all adapters at once (docs/design/lora.md).

Each targeted projection holds its device slots' ``A`` stacked as ``[slots * max_rank, in]``
and ``B`` as ``[out, slots * max_rank]`` (``scheduler_proc.lora.slots``). A pass with adapter
rows carries one mask ``[tokens, width]`` over the first ``width`` stacked columns (every
slot's under deterministic inference, else those up to the pass's highest slot in use): a
token's row holds its adapter's scaling over its slot's columns and zeros elsewhere. The
delta is then two matmuls, ``((x @ A^T) * mask) @ B^T``, with no loop over rows or
adapters; a base token's row of the mask is zeros, so its delta is zeros and its output the
base model's, bit for bit. Both matmuls are the projection's own (batch-invariant under
deterministic inference)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class LoraPass:
    """What every targeted projection of one pass reads: the scaled slot mask."""

    mask: torch.Tensor  # [tokens, width], the model's dtype: the first width stacked columns

    @classmethod
    def build(
        cls,
        token_slots: torch.Tensor,
        column_slots: torch.Tensor,
        column_scaling: torch.Tensor,
    ) -> LoraPass:
        """``token_slots`` [T] int64, each token's slot (-1: the base model);
        ``column_slots`` [slots * max_rank], the slot of each stacked column;
        ``column_scaling`` [slots * max_rank], that slot's adapter's scaling."""
        own = token_slots.to(column_slots.device)[:, None] == column_slots[None, :]
        return cls(torch.where(own, column_scaling, torch.zeros_like(column_scaling)))


def add_delta(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stacked: torch.Tensor,
    b_stacked: torch.Tensor,
    lora: LoraPass,
    linear: LinearFn,
) -> torch.Tensor:
    """``y + ((x @ A^T) * mask) @ B^T`` over the mask's columns, both matmuls through
    ``linear``."""
    width = lora.mask.shape[1]
    a, b = a_stacked[:width], b_stacked[:, :width]
    return y + linear(linear(x, a, None) * lora.mask, b, None)
