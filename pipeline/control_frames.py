"""The control messages an API worker sends the scheduler between its steps, and the
scheduler's answers (wire types, as in ``pipeline.io_struct``, whose unions take these in;
docs/wire.md describes each one). Every control carries a ``control_id`` whose high bits
name the asking API worker (``pipeline.worker_ids``): its answer goes back to that worker
alone, with the same id. Field order is the wire contract: new fields go last."""

from __future__ import annotations

from typing import Literal

import msgspec

# How a pause treats the requests in flight: SGLang's three (abort, retract, in_place) and
# vLLM's wait; vLLM's keep is in_place (tokenizer_proc/http/rollout_api.py maps it).
PauseMode = Literal["abort", "retract", "in_place", "wait"]


# --- API -> scheduler ------------------------------------------------------------------


class HiCacheStorageControl(
    msgspec.Struct, tag="hicache_storage", array_like=True, omit_defaults=True, gc=False
):
    """API -> scheduler: attach (``backend`` at ``dir``) or detach the HiCache storage
    tier at runtime. The scheduler answers with a ``HiCacheStorageState`` of the same
    ``control_id``."""

    control_id: int
    attach: bool
    backend: str = ""
    dir: str = ""


class FlushCacheControl(
    msgspec.Struct, tag="flush_cache", array_like=True, omit_defaults=True, gc=False
):
    """API -> scheduler: drop the prefix cache, on every tier (``POST /flush_cache``). The
    scheduler answers with a ``FlushCacheResult`` of the same ``control_id``."""

    control_id: int


class PauseControl(msgspec.Struct, tag="pause", array_like=True, omit_defaults=True, gc=False):
    """API -> scheduler: stop running steps (``POST /pause_generation``, vLLM's ``/pause``)
    after treating the requests in flight as ``mode`` says. Answered with a
    ``RolloutState`` once paused: at once, or for ``wait`` when the running requests
    finished."""

    control_id: int
    mode: PauseMode = "abort"


class ContinueControl(
    msgspec.Struct, tag="continue", array_like=True, omit_defaults=True, gc=False
):
    """API -> scheduler: run steps again (``POST /continue_generation``, vLLM's
    ``/resume``). Answered with a ``RolloutState``."""

    control_id: int


class UpdateWeightsControl(
    msgspec.Struct, tag="update_weights", array_like=True, omit_defaults=True, gc=False
):
    """API -> scheduler: load the safetensors of ``model_path`` (the served architecture and
    shapes) and swap them in between two steps (``POST /update_weights_from_disk``). Not
    paused, the swap waits until no request holds KV, admitting none meanwhile;
    ``abort_all_requests`` aborts them instead. ``flush_cache`` drops the prefix cache
    after the swap. Answered with a ``RolloutState``; a failed load changes nothing."""

    control_id: int
    model_path: str
    weight_version: str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True


class LoraAdapter(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One adapter the scheduler serves: its name (the ``model`` a request names), the
    directory it was read from, and its load id (vLLM's ``lora_int_id``, from 1): loading
    under a name again gives a new id, so nothing cached for the old weights is reused."""

    name: str
    path: str
    id: int


class LoadLoraControl(msgspec.Struct, tag="load_lora", array_like=True, gc=False):
    """API -> scheduler: read the PEFT adapter in ``path`` and serve it as ``name``
    (``/v1/load_lora_adapter``, SGLang's ``/load_lora_adapter``). Answered with a
    ``LoraControlResult``; an adapter that cannot be served changes nothing."""

    control_id: int
    name: str
    path: str


class UnloadLoraControl(msgspec.Struct, tag="unload_lora", array_like=True, gc=False):
    """API -> scheduler: stop serving adapter ``name`` to new requests (those running on
    it finish on it). Answered with a ``LoraControlResult``."""

    control_id: int
    name: str


ControlInput = (
    HiCacheStorageControl
    | FlushCacheControl
    | PauseControl
    | ContinueControl
    | UpdateWeightsControl
    | LoadLoraControl
    | UnloadLoraControl
)


# --- scheduler -> API (through the detokenizer, untouched) ------------------------------


class HiCacheStorageState(
    msgspec.Struct, tag="hicache_storage_state", array_like=True, omit_defaults=True, gc=False
):
    """Scheduler -> API (through the detokenizer, untouched): the answer to one
    ``HiCacheStorageControl``. ``ok`` False carries the reason in ``error`` (and the request
    field it is about in ``param``) and leaves the state as it was. ``backend`` and ``dir``
    are the storage attached after the call, None when none is."""

    control_id: int
    ok: bool
    error: str = ""
    param: str | None = None
    backend: str | None = None
    dir: str | None = None


class FlushCacheResult(
    msgspec.Struct, tag="flush_cache_result", array_like=True, omit_defaults=True, gc=False
):
    """Scheduler -> API (through the detokenizer, untouched): the answer to one
    ``FlushCacheControl``. ``ok`` False (requests were running or waiting: nothing was
    dropped) carries the reason in ``error``. The token counts are what the flush dropped
    from each tier of the prefix cache."""

    control_id: int
    ok: bool
    error: str = ""
    device_tokens: int = 0
    host_tokens: int = 0
    storage_tokens: int = 0


class AbortResult(msgspec.Struct, tag="abort_result", array_like=True, gc=False):
    """Scheduler -> API (through the detokenizer, untouched): the answer to an ``AbortReq``
    with a ``control_id``: how many requests it stopped."""

    control_id: int
    aborted: int


class RolloutState(msgspec.Struct, tag="rollout_state", array_like=True, gc=False):
    """The answer to a ``PauseControl``, ``ContinueControl`` or ``UpdateWeightsControl``:
    whether it was carried out (``message`` says why not, or what was done), and the state
    after it: the pause mode (None: running), the weights' version, the live requests held
    while paused or during the swap, and an update's seconds from its control to the swap."""

    control_id: int
    ok: bool
    message: str = ""
    paused: PauseMode | None = None
    weight_version: str = "default"
    num_paused_requests: int = 0
    seconds: float = 0.0


class LoraControlResult(
    msgspec.Struct, tag="lora_result", array_like=True, omit_defaults=True, gc=False
):
    """Scheduler -> API: the answer to a ``LoadLoraControl`` or ``UnloadLoraControl``.
    ``ok`` False carries the reason in ``error`` and the HTTP status it deserves
    (``status_code``: 404 for an unknown name, 400 otherwise). ``adapters``: every adapter
    served after the call."""

    control_id: int
    ok: bool
    error: str = ""
    status_code: int = 200
    adapters: tuple[LoraAdapter, ...] = ()


# The scheduler's answers to control messages: each goes back to the API worker whose
# index its control_id carries.
ControlAnswer = (
    HiCacheStorageState | FlushCacheResult | AbortResult | RolloutState | LoraControlResult
)
