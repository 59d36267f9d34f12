"""A LoRA request's way into the batch (docs/design/lora.md): the adapter its message names
(``bind``), and a device slot that holds the adapter while the request is live. A request
whose adapter finds every slot pinned by other adapters' requests waits here, outside the
waiting queue, as a request whose grammar compiles waits in the grammar queue; each step
``take`` hands on, in arrival order, those whose adapter got a slot. A slot is pinned from a
request's entry into the waiting queue until its release (a retraction keeps it), so a
running or queued request never loses its adapter. With LoRA off nothing waits here, and a
request that names an adapter is refused."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain
from typing import TypedDict

from pipeline.control_frames import LoraAdapter
from pipeline.io_struct import FinishAbort, LoraRef
from scheduler_proc.lora.adapter_files import LoraError
from scheduler_proc.lora.runtime import LoraRuntime
from scheduler_proc.req import Req


class LoraReportFields(TypedDict, total=False):
    lora_adapters: tuple[LoraAdapter, ...]
    max_loras: int
    running_lora_adapters: tuple[str, ...]
    waiting_lora_adapters: tuple[str, ...]


class LoraQueue:
    def __init__(self, lora: LoraRuntime | None) -> None:
        self._lora = lora  # None: LoRA is off
        self._waiting: list[Req] = []  # in arrival order

    def __len__(self) -> int:
        return len(self._waiting)

    def bind(self, req: Req, ref: LoraRef | None) -> str | None:
        """Gives ``req`` the adapter ``ref`` names; why it cannot have it, or None. The API
        worker resolved the name from the last report: an unload may have come between."""
        if ref is None:
            return None
        if self._lora is None:
            return f"LoRA adapter {ref.name!r} is named, and this server runs without --enable-lora"
        adapter = self._lora.registry.by_id(ref.id)
        if adapter is None or adapter.name != ref.name:
            return f"LoRA adapter {ref.name!r} is no longer loaded"
        req.lora = adapter
        return None

    def bind_named(self, req: Req, name: str | None) -> str | None:
        """As ``bind``, for a PD re-bootstrap, which names its adapter by name alone (the
        decode server's load ids are not this server's)."""
        if name is None:
            return None
        adapter = None if self._lora is None else self._lora.registry.by_name(name)
        if adapter is None:
            return f"LoRA adapter {name!r} is not loaded on this prefill server"
        return self.bind(req, LoraRef(name, adapter.id))

    def admit(self, req: Req) -> bool:
        """Pins the request's adapter in a slot: True when it may queue (the base model, or
        its slot is held), False when it waits here."""
        if req.lora is None or req.lora_slot >= 0:
            return True
        if self._pin(req):
            return True
        self._waiting.append(req)
        return False

    def take(self) -> list[Req]:
        """The waiting requests whose adapter got a slot, in arrival order, and those that
        cannot have it (finished, with the reason)."""
        ready: list[Req] = []
        still: list[Req] = []
        for req in self._waiting:
            (ready if req.finished or self._pin(req) else still).append(req)
        self._waiting = still
        return ready

    def remove(self, req: Req) -> bool:
        """Forgets a waiting request (aborted); whether it was here."""
        if req in self._waiting:
            self._waiting.remove(req)
            return True
        return False

    def release(self, req: Req) -> None:
        """The request is done with its adapter's slot (released: finished or aborted)."""
        if req.lora is not None and req.lora_slot >= 0 and self._lora is not None:
            self._lora.release(req.lora)
        req.lora_slot = -1

    def _pin(self, req: Req) -> bool:
        """Whether the request holds its slot now; a request whose adapter can no longer be
        read is finished (``take`` hands it on, to send its row)."""
        assert self._lora is not None and req.lora is not None
        try:
            slot = self._lora.acquire(req.lora)
        except LoraError as exc:
            req.finish(FinishAbort(message=str(exc), status_code=exc.status_code))
            return False
        if slot is None:
            return False
        req.lora_slot = slot
        return True

    def report_fields(
        self, running: Iterable[Req], prefilling: Iterable[Req], waiting: Iterable[Req]
    ) -> LoraReportFields:
        """The LoRA fields of a ``SchedulerStatsReport`` (none with LoRA off): the adapters
        served, the slots, and the adapters of the running and of the waiting requests."""
        if self._lora is None:
            return LoraReportFields()
        return {
            "lora_adapters": self._lora.registry.adapters(),
            "max_loras": self._lora.slots.num_slots,
            "running_lora_adapters": _names(chain(running, prefilling)),
            "waiting_lora_adapters": _names(chain(waiting, self._waiting)),
        }


def _names(reqs: Iterable[Req]) -> tuple[str, ...]:
    return tuple(sorted({req.lora.name for req in reqs if req.lora is not None}))
