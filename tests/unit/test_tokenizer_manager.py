"""The tokenizer manager's request bookkeeping, on real sockets but without HTTP."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import get_args

import msgspec
import pytest
import zmq

from pipeline.server_args import check_config
from pipeline.config import ServerConfig
from pipeline.io_struct import AbortReq, SamplingParams, SchedulerInput, TokenizerManagerInput
from pipeline.sockets import FrameDecoder
from pipeline.tokenizer_loader import load_tokenizer
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.metrics import NoMetrics, ServiceMetrics
from tokenizer_proc.tokenizer_manager import TokenizerManager
from tokenizer_proc.tracers import NoTracer

DUPLICATE = (
    r"^Duplicate request ID detected: same \(a request with rid 'same' is already running\)$"
)


def _manager(tmp_path: Path) -> TokenizerManager:
    config = ServerConfig(
        scheduler_input=f"ipc://{tmp_path}/sched",
        tokenizer_input=f"ipc://{tmp_path}/tm",
        max_total_tokens=4096,
    )
    return TokenizerManager(config, load_tokenizer(None), context_length=2048)


def test_duplicate_live_rid_is_refused_and_reusable_after_finish(tmp_path: Path) -> None:
    async def scenario() -> list[object]:
        tm = _manager(tmp_path)
        scheduler_inbox = zmq.Context.instance().socket(zmq.PULL)
        scheduler_inbox.bind(tm.config.scheduler_input)
        await tm.start()
        try:
            first = tm.submit_generate(
                input_ids=[1, 2], sampling=SamplingParams(), stream=False, rid="same"
            )
            with pytest.raises(RequestValidationError, match=DUPLICATE):
                tm.submit_generate(
                    input_ids=[1, 2], sampling=SamplingParams(), stream=False, rid="same"
                )
            tm.abort(first.req_id)
            tm.forget(first)
            second = tm.submit_generate(
                input_ids=[3], sampling=SamplingParams(), stream=False, rid="same"
            )
            assert second.req_id != first.req_id
            decoder: FrameDecoder[SchedulerInput] = FrameDecoder(
                SchedulerInput, logging.getLogger("t"), "t"
            )
            return [decoder.decode(scheduler_inbox.recv()) for _ in range(4)]
        finally:
            await tm.close()
            scheduler_inbox.close(0)

    sent = asyncio.run(scenario())
    # A (re)started manager first stops whatever an earlier incarnation left in the scheduler.
    assert isinstance(sent[0], AbortReq) and sent[0].abort_all
    sent = sent[1:]
    assert [type(m).__name__ for m in sent] == [
        "TokenizedGenerateReqInput",
        "AbortReq",
        "TokenizedGenerateReqInput",
    ]
    assert isinstance(sent[1], AbortReq)
    assert sent[1].req_id == sent[0].req_id  # type: ignore[union-attr]


def test_req_ids_are_never_reused_and_carry_the_worker_index(tmp_path: Path) -> None:
    config = ServerConfig(scheduler_input="ipc:///unused", tokenizer_input="ipc:///unused")
    tm = TokenizerManager(config, load_tokenizer(None), context_length=2048, worker_index=3)
    ids = [next(tm._next_req_id) for _ in range(1000)]
    assert len(set(ids)) == 1000 and all(i >> 56 == 3 for i in ids)


def test_each_api_worker_has_its_own_endpoint_and_ids() -> None:
    config = ServerConfig(
        scheduler_input="ipc:///s",
        tokenizer_input="ipc:///d/tokenizer",
        api_workers=3,
        api_worker_index=2,
    )
    check_config(config)
    assert [config.tokenizer_endpoint(i) for i in range(3)] == [
        "ipc:///d/tokenizer-0",
        "ipc:///d/tokenizer-1",
        "ipc:///d/tokenizer-2",
    ]
    tcp = msgspec.structs.replace(config, tokenizer_input="tcp://10.0.0.2:5600")
    assert [tcp.tokenizer_endpoint(i) for i in range(3)] == [
        "tcp://10.0.0.2:5600",
        "tcp://10.0.0.2:5601",
        "tcp://10.0.0.2:5602",
    ]
    single = ServerConfig(tokenizer_input="ipc:///d/tokenizer")
    assert single.tokenizer_endpoint(0) == "ipc:///d/tokenizer" and single.api_name == "api"
    assert config.api_name == "api-2"
    tm = TokenizerManager(config, load_tokenizer(None), context_length=2048)
    assert next(tm._next_req_id) >> 56 == 2 and next(tm.controls._next_control_id) >> 56 == 2
    for bad in (
        {"api_workers": 0},
        {"api_workers": 128},
        {"api_workers": 2, "api_worker_index": 2},
    ):
        with pytest.raises(ValueError, match="api-worker"):
            check_config(msgspec.structs.replace(config, **bad))


def test_the_manager_has_a_row_for_every_message_of_its_socket(tmp_path: Path) -> None:
    table = _manager(tmp_path).dispatcher
    assert table.message_types == frozenset(get_args(TokenizerManagerInput))


def test_metrics_and_tracing_off_are_objects_that_do_nothing(tmp_path: Path) -> None:
    """Off, each is still there (callers never test for None): NoMetrics renders an empty
    /metrics and observes nothing, NoTracer records no span and has no exporter."""
    config = ServerConfig(
        scheduler_input=f"ipc://{tmp_path}/sched",
        tokenizer_input=f"ipc://{tmp_path}/tm",
        enable_metrics=False,
    )
    tm = TokenizerManager(config, load_tokenizer(None), context_length=2048)
    assert isinstance(tm.metrics, NoMetrics) and tm.metrics.render() == b""
    assert isinstance(tm.tracer, NoTracer)
    on = _manager(tmp_path)
    assert isinstance(on.metrics, ServiceMetrics) and isinstance(on.tracer, NoTracer)
