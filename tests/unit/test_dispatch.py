"""Message dispatch as a table (``pipeline.dispatch``): each message type reaches its own
handler with the extra arguments, a type listed twice is refused, and the detokenizer's
table has a row for every message its socket can carry."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest
import zmq

from detokenizer_proc.main import Detokenizer
from pipeline.config import ServerConfig
from pipeline.dispatch import TypeDispatcher, route
from pipeline.control_frames import AbortResult, FlushCacheResult
from pipeline.io_struct import DetokenizerInput


def test_each_message_reaches_the_handler_of_its_type() -> None:
    seen: list[tuple[str, int, int]] = []

    def on_abort(msg: AbortResult, step: int) -> None:
        seen.append(("abort", msg.control_id, step))

    def on_flush(msg: FlushCacheResult, step: int) -> None:
        seen.append(("flush", msg.control_id, step))

    table = TypeDispatcher([route(AbortResult, on_abort), route(FlushCacheResult, on_flush)])
    table.dispatch(FlushCacheResult(control_id=7, ok=True), 1)
    table.dispatch(AbortResult(control_id=8, aborted=0), 2)
    assert seen == [("flush", 7, 1), ("abort", 8, 2)]


def test_a_type_listed_twice_is_refused() -> None:
    def on_abort(msg: AbortResult) -> None:
        pass

    with pytest.raises(ValueError, match="two handlers for AbortResult"):
        TypeDispatcher([route(AbortResult, on_abort), route(AbortResult, on_abort)])


def test_the_detokenizer_has_a_row_for_every_message_of_its_socket(tmp_path: Path) -> None:
    config = ServerConfig(
        skip_tokenizer_init=True,
        detokenizer_input=f"ipc://{tmp_path}/detokenizer",
        tokenizer_input=f"ipc://{tmp_path}/tokenizer",
    )
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        table = Detokenizer(config, ctx).dispatcher
        assert table.message_types == frozenset(get_args(DetokenizerInput))
    finally:
        ctx.destroy(linger=0)
