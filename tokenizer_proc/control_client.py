"""Control round trips from an API worker to the scheduler: HiCache storage, /flush_cache,
aborting another API worker's request by rid, the rollout controls (pause, continue,
new weights) and LoRA adapters (load, unload). Each sends one message with a
``control_id`` and waits for the scheduler's answer of the same id, which comes between two
scheduler steps through the same socket as the output frames (``handle_output`` hands it to
``answer``)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import TypeVar

from pipeline.control_frames import (
    AbortResult,
    ContinueControl,
    ControlAnswer,
    FlushCacheControl,
    FlushCacheResult,
    HiCacheStorageControl,
    HiCacheStorageState,
    LoadLoraControl,
    LoraControlResult,
    PauseControl,
    PauseMode,
    RolloutState,
    UnloadLoraControl,
    UpdateWeightsControl,
)
from pipeline.io_struct import AbortReq, SchedulerInput
from pipeline.worker_ids import WORKER_SHIFT

# The scheduler's answers to control messages are matched to their call by ``control_id``.
_Answer = TypeVar(
    "_Answer", HiCacheStorageState, FlushCacheResult, AbortResult, RolloutState, LoraControlResult
)


class ControlClient:
    def __init__(self, send: Callable[[SchedulerInput], None], worker_index: int) -> None:
        self._send = send
        # The worker index lives in the high bits, as in a req_id (``worker_ids.WORKER_SHIFT``),
        # so the scheduler's answer goes back to the worker that asked.
        self._next_control_id = itertools.count((worker_index << WORKER_SHIFT) + 1)
        self._controls: dict[
            int, asyncio.Future[ControlAnswer]
        ] = {}  # the calls waiting, by control_id

    def answer(self, frame: ControlAnswer) -> None:
        """Hands the scheduler's answer to the call waiting for it (none: it timed out)."""
        future = self._controls.pop(frame.control_id, None)
        if future is not None and not future.done():
            future.set_result(frame)

    async def abort_elsewhere(self, rid: str, reason: str, timeout: float) -> bool:
        """Asks the scheduler to stop request ``rid`` of another API worker (--api-workers);
        whether it stopped one. Its finished row goes to its own worker."""
        answer = await self._round_trip(
            lambda control_id: AbortReq(rid=rid, reason=reason, control_id=control_id),
            AbortResult,
            timeout,
        )
        return answer is not None and answer.aborted > 0

    async def hicache_storage(
        self, *, attach: bool, backend: str = "", dir: str = "", timeout: float = 30.0
    ) -> HiCacheStorageState | None:
        """Asks the scheduler to attach or detach HiCache storage and waits for its answer
        (it comes between two scheduler steps); None when none came within ``timeout``."""
        return await self._round_trip(
            lambda control_id: HiCacheStorageControl(
                control_id=control_id, attach=attach, backend=backend, dir=dir
            ),
            HiCacheStorageState,
            timeout,
        )

    async def flush_cache(self, timeout: float = 30.0) -> FlushCacheResult | None:
        """Asks the scheduler to drop its prefix cache and waits for its answer; None when
        none came within ``timeout``."""
        return await self._round_trip(FlushCacheControl, FlushCacheResult, timeout)

    async def pause(self, mode: PauseMode, timeout: float | None) -> RolloutState | None:
        """Pauses generation (``PauseControl``); None when no answer came in ``timeout``
        (None: as long as it takes, for a wait that drains the running requests)."""
        return await self._round_trip(
            lambda control_id: PauseControl(control_id=control_id, mode=mode),
            RolloutState,
            timeout,
        )

    async def resume(self, timeout: float = 30.0) -> RolloutState | None:
        """Continues generation after a pause (``ContinueControl``)."""
        return await self._round_trip(ContinueControl, RolloutState, timeout)

    async def update_weights(
        self,
        model_path: str,
        *,
        weight_version: str | None,
        abort_all_requests: bool,
        flush_cache: bool,
    ) -> RolloutState | None:
        """Swaps in the weights of ``model_path`` (``UpdateWeightsControl``), waiting as long
        as the read and the safe point take."""
        return await self._round_trip(
            lambda control_id: UpdateWeightsControl(
                control_id=control_id,
                model_path=model_path,
                weight_version=weight_version,
                abort_all_requests=abort_all_requests,
                flush_cache=flush_cache,
            ),
            RolloutState,
            None,
        )

    async def load_lora(self, name: str, path: str, timeout: float) -> LoraControlResult | None:
        """Asks the scheduler to read the adapter in ``path`` and serve it as ``name``
        (``LoadLoraControl``); None when no answer came within ``timeout``."""
        return await self._round_trip(
            lambda control_id: LoadLoraControl(control_id=control_id, name=name, path=path),
            LoraControlResult,
            timeout,
        )

    async def unload_lora(self, name: str, timeout: float) -> LoraControlResult | None:
        """Asks the scheduler to stop serving adapter ``name`` to new requests
        (``UnloadLoraControl``); None when no answer came within ``timeout``."""
        return await self._round_trip(
            lambda control_id: UnloadLoraControl(control_id=control_id, name=name),
            LoraControlResult,
            timeout,
        )

    async def _round_trip(
        self,
        message: Callable[[int], SchedulerInput],
        answer: type[_Answer],
        timeout: float | None,
    ) -> _Answer | None:
        """Sends one control message, ``message`` of a new control_id, and waits for the
        scheduler's answer of the same id (None: none within ``timeout``)."""
        control_id = next(self._next_control_id)
        future: asyncio.Future[ControlAnswer] = asyncio.get_running_loop().create_future()
        self._controls[control_id] = future
        try:
            self._send(message(control_id))
            got = await asyncio.wait_for(future, timeout)
        except TimeoutError:
            return None
        finally:
            self._controls.pop(control_id, None)
        return got if isinstance(got, answer) else None
