"""The scheduler process's loop (``scheduler_proc.main.SchedulerLoop``): its message table
has a row for every message its socket can carry, so a new message type cannot be dropped
by a missing branch."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import zmq

from pipeline.config import ServerConfig
from pipeline.io_struct import SchedulerInput
from scheduler_proc.main import SchedulerLoop, build_scheduler


def test_the_scheduler_has_a_row_for_every_message_of_its_socket(tmp_path: Path) -> None:
    config = ServerConfig(
        max_total_tokens=512,
        torch_threads=1,
        scheduler_input=f"ipc://{tmp_path}/scheduler",
        detokenizer_input=f"ipc://{tmp_path}/detokenizer",
    )
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        table = SchedulerLoop(config, build_scheduler(config), ctx).dispatcher
        assert table.message_types == frozenset(get_args(SchedulerInput))
    finally:
        ctx.destroy(linger=0)
