"""The control messages the scheduler carries out between two steps: which requests an
abort names, HiCache storage attach and detach, flushing the prefix cache, and loading and
unloading LoRA adapters."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from pipeline.control_frames import (
    FlushCacheControl,
    FlushCacheResult,
    HiCacheStorageControl,
    HiCacheStorageState,
    LoadLoraControl,
    LoraControlResult,
    UnloadLoraControl,
)
from pipeline.io_struct import AbortReq
from pipeline.request_ids import names_choice
from pipeline.worker_ids import worker_of
from scheduler_proc.cache.hicache import HiCache, NoHiCache, cached_details
from scheduler_proc.cache.prefix_kv import PrefixKV
from scheduler_proc.lora.adapter_files import LoraError
from scheduler_proc.lora.runtime import LoraRuntime
from scheduler_proc.req import Req

logger = logging.getLogger("tokenpipe.scheduler")


def abort_targets(msg: AbortReq, live: dict[int, Req]) -> list[Req]:
    """The live requests an abort names: all of them (of one API worker, when it names
    one), those with its rid (else every choice of the OpenAI request the rid names:
    ``pipeline/request_ids.py``), or the one with its req_id."""
    if msg.abort_all:
        return [r for r in live.values() if msg.worker is None or worker_of(r.req_id) == msg.worker]
    if msg.rid is not None:  # from an API worker that does not hold the request
        # Never an internal request (a PD KV job: negative req_id).
        outside = [r for r in live.values() if r.req_id >= 0]
        exact = [r for r in outside if r.rid == msg.rid]
        return exact or [r for r in outside if names_choice(msg.rid, r.rid)]
    return [live[msg.req_id]] if msg.req_id in live else []


def storage_control(
    hicache: HiCache | NoHiCache, live: Iterable[Req], msg: HiCacheStorageControl
) -> HiCacheStorageState:
    """Attaches or detaches HiCache storage. On a change, every admitted live request's
    ``cached_tokens_details`` changes keys through the one stats setter, so its next row
    shows the storage keys appear or go."""
    state = hicache.apply_storage_control(msg)
    backend = state.backend
    for req in live:
        if req.admitted_once:
            details = cached_details(*req.cached_by_tier, backend)
            if details != req.stats.cached_tokens_details:
                req.update_stats(cached_tokens_details=details)
    return state


def flush_cache(
    prefix_kv: PrefixKV, num_live: int, num_waiting: int, num_running: int, msg: FlushCacheControl
) -> FlushCacheResult:
    """Drops the prefix cache, as SGLang's ``flush_cache`` does: only when no request is
    live (waiting, running, or in a PD hand-over), else nothing changes and the answer
    says why."""
    if num_live:
        error = (
            "Cache not flushed because there are pending requests. "
            f"#queue-req: {num_waiting}, #running-req: {num_running}"
        )
        logger.warning(error)
        return FlushCacheResult(control_id=msg.control_id, ok=False, error=error)
    dropped = prefix_kv.flush()
    logger.info("cache flushed: %d device, %d host and %d storage tokens dropped", *dropped)
    return FlushCacheResult(
        control_id=msg.control_id,
        ok=True,
        device_tokens=dropped.device,
        host_tokens=dropped.host,
        storage_tokens=dropped.storage,
    )


def lora_control(
    lora: LoraRuntime | None, msg: LoadLoraControl | UnloadLoraControl
) -> LoraControlResult:
    """Loads (reads and checks the files now) or unloads an adapter. Requests running on an
    unloaded adapter finish on it; a new request cannot name it."""
    if lora is None:
        return LoraControlResult(
            control_id=msg.control_id,
            ok=False,
            error="LoRA adapters are not enabled on this server: start it with --enable-lora",
            status_code=400,
        )
    try:
        if isinstance(msg, LoadLoraControl):
            adapter = lora.registry.load(msg.name, msg.path)
            logger.info("loaded LoRA adapter %r (id %d) from %s", msg.name, adapter.id, msg.path)
        else:
            lora.registry.unload(msg.name)
            logger.info("unloaded LoRA adapter %r", msg.name)
    except LoraError as exc:
        return LoraControlResult(
            control_id=msg.control_id,
            ok=False,
            error=str(exc),
            status_code=exc.status_code,
            adapters=lora.registry.adapters(),
        )
    return LoraControlResult(control_id=msg.control_id, ok=True, adapters=lora.registry.adapters())
