"""The device slots adapters run from: ``num_slots`` of ``max_rank`` columns each, stacked
on every projection an adapter may change (``Linear.lora_a`` [slots * max_rank, in],
``Linear.lora_b`` [out, slots * max_rank], the model's dtype and device, zeros where no
adapter is). An adapter is copied into a free slot, or the least recently used one no live
request pins, when a request needs it and no slot holds it; a slot stays pinned while any
request counts on it (``acquire`` / ``release``, counted). Copies are per projection, never
per row; what a pass reads is ``pass_for``'s mask (``scheduler_proc.model.lora_delta``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipeline.control_frames import LoraAdapter
from scheduler_proc.lora.adapter_files import PROJECTIONS, LoraWeights
from scheduler_proc.model.llama import LlamaForCausalLM, Linear
from scheduler_proc.model.lora_delta import LoraPass


class LoraSlots:
    def __init__(self, model: LlamaForCausalLM, num_slots: int, max_rank: int) -> None:
        self.num_slots, self.max_rank = num_slots, max_rank
        self._projections: list[dict[str, Linear]] = []
        width = num_slots * max_rank
        for layer in model.model.layers:
            own: dict[str, Linear] = {}
            for proj, parent in PROJECTIONS.items():
                linear = getattr(getattr(layer, parent), proj)
                n_out, n_in = linear.weight.shape
                like = {"device": linear.weight.device, "dtype": linear.weight.dtype}
                linear.lora_a = torch.zeros((width, n_in), **like)
                linear.lora_b = torch.zeros((n_out, width), **like)
                own[proj] = linear
            self._projections.append(own)
        device = model.device
        # Per stacked column: its slot, and the scaling of the adapter in that slot.
        self.column_slots = torch.arange(width, device=device) // max_rank
        self.column_scaling = torch.zeros(width, device=device, dtype=model.dtype)
        self._holder: list[int | None] = [None] * num_slots  # adapter id per slot
        self._pins = [0] * num_slots
        self._last_use = [0] * num_slots
        self._clock = 0
        # Deterministic inference reads every slot's columns in every pass, so a row's sums
        # never change length with its batch; otherwise a pass reads only the columns up to
        # its highest slot in use (one adapter in slot 0 costs one slot, not all of them).
        self._full_width = model.deterministic

    def slot_of(self, adapter_id: int) -> int | None:
        """The slot that holds the adapter of this load id, if one does."""
        try:
            return self._holder.index(adapter_id)
        except ValueError:
            return None

    def acquire(
        self, adapter: LoraAdapter, weights: Callable[[LoraAdapter], LoraWeights]
    ) -> int | None:
        """Pin a slot holding ``adapter``, copying it in (``weights`` reads it) when no slot
        does; None when every slot is pinned by other adapters."""
        slot = self.slot_of(adapter.id)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            self._copy_in(slot, weights(adapter))
            self._holder[slot] = adapter.id
        self._pins[slot] += 1
        self._clock += 1
        self._last_use[slot] = self._clock
        return slot

    def release(self, adapter_id: int) -> None:
        """Unpin once the slot ``acquire`` pinned for this adapter."""
        slot = self.slot_of(adapter_id)
        if slot is None or self._pins[slot] == 0:
            raise ValueError(f"LoraSlots.release: adapter id {adapter_id} holds no pinned slot")
        self._pins[slot] -= 1

    def pins(self, slot: int) -> int:
        return self._pins[slot]

    def pass_for(self, token_slots: torch.Tensor) -> LoraPass:
        """The mask of a pass whose tokens use ``token_slots`` [T] int64 (-1: base), over
        the stacked columns it reads."""
        used = self.num_slots if self._full_width else int(token_slots.max()) + 1
        width = used * self.max_rank
        return LoraPass.build(token_slots, self.column_slots[:width], self.column_scaling[:width])

    def _free_slot(self) -> int | None:
        unpinned = [s for s in range(self.num_slots) if self._pins[s] == 0]
        if not unpinned:
            return None
        empty = [s for s in unpinned if self._holder[s] is None]
        return empty[0] if empty else min(unpinned, key=self._last_use.__getitem__)

    def _copy_in(self, slot: int, weights: LoraWeights) -> None:
        """The adapter's A and B into the slot's columns, zero past its rank and on every
        projection it leaves alone."""
        cols = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        rank = weights.rank
        with torch.no_grad():
            for layer, own in enumerate(self._projections):
                for proj, linear in own.items():
                    a, b = linear.lora_a, linear.lora_b
                    assert a is not None and b is not None  # set in __init__
                    a[cols].zero_()
                    b[:, cols].zero_()
                    pair = weights.pairs.get((layer, proj))
                    if pair is not None:
                        a[cols][:rank].copy_(pair.a)
                        b[:, cols][:, :rank].copy_(pair.b)
            self.column_scaling[cols] = weights.scaling
