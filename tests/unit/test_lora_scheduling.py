"""LoRA requests through the scheduler, step by step (scheduler_proc/lora_queue.py; real
checkpoint, adapters written by peft, real pool and cache): mixed adapters and the base in
one batch give each request its solo tokens; more adapters than slots make requests wait
outside the queue, counted as waiting and reported; a retraction keeps the adapter; the
prefix cache never shares KV across adapters; an unload stops new requests only, and an
adapter whose files went away fails its requests, not the scheduler."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pipeline.columns import from_column, split_token_rows
from pipeline.config import ServerConfig
from pipeline.control_frames import LoadLoraControl, UnloadLoraControl
from pipeline.io_struct import (
    REQ_ID_DTYPE,
    BatchTokenIDOutput,
    FinishAbort,
    LoraRef,
    RequestOutputStats,
    SamplingParams,
    TokenizedGenerateReqInput,
)
from scheduler_proc.control import lora_control
from scheduler_proc.main import build_or_exit, build_scheduler
from scheduler_proc.scheduler import Scheduler
from scheduler_proc.stats_reporter import SchedulerStatsReporter
from tests.hf_checkpoints import write_case
from tests.lora_adapters import write_adapter

PROMPT = [(37 * i + 11) % 900 + 40 for i in range(40)]
ADAPTERS: dict[str, dict[str, Any]] = {
    "a": {"rank": 4, "alpha": 8, "seed": 1},
    "b": {"rank": 8, "alpha": 8, "seed": 2},
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("lora-scheduling")
    write_case(root / "base", "llama3")
    adapters = {n: write_adapter(root / "base", root / n, **kw) for n, kw in ADAPTERS.items()}
    return root / "base", adapters


def scheduler(checkpoint: tuple[Path, dict[str, Path]], **flags: object) -> Scheduler:
    base, adapters = checkpoint
    defaults: dict[str, object] = {
        "max_total_tokens": 4096,
        "chunked_prefill_size": 256,
        "max_loras": 2,
        "max_lora_rank": 8,
    }
    config = ServerConfig(
        model_path=str(base),
        device="cpu",
        torch_threads=1,
        enable_deterministic_inference=True,  # a row's bits never depend on its batch
        lora_modules=tuple(f"{name}={path}" for name, path in adapters.items()),
        **{**defaults, **flags},  # type: ignore[arg-type]
    )
    return build_scheduler(config)


def ref(s: Scheduler, name: str | None) -> LoraRef | None:
    if name is None:
        return None
    assert s.runner.lora is not None
    adapter = s.runner.lora.registry.by_name(name)
    assert adapter is not None
    return LoraRef(name, adapter.id)


def submit(
    s: Scheduler, req_id: int, lora: LoraRef | None, prompt: list[int] = PROMPT, max_new: int = 8
) -> None:
    s.add_request(
        TokenizedGenerateReqInput(
            rid=f"r{req_id}",
            req_id=req_id,
            input_ids=prompt,
            sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0.0),
            stream=True,
            arrival_time=time.time(),
            lora=lora,
        )
    )


class Run(msgspec.Struct):
    tokens: dict[int, list[int]]
    stats: dict[int, RequestOutputStats]
    aborts: dict[int, FinishAbort]
    first_step: dict[int, int]
    last_step: dict[int, int]


def run(s: Scheduler) -> Run:
    out = Run({}, {}, {}, {}, {})
    step = 0
    while s.has_work():
        step += 1
        for frame in s.step():
            assert isinstance(frame, BatchTokenIDOutput)
            frame = msgspec.msgpack.decode(msgspec.msgpack.encode(frame), type=type(frame))
            n = len(frame.output_counts)
            reasons = frame.finished_reasons or [None] * n
            stats = frame.request_stats or [None] * n
            rows = split_token_rows(frame.output_ids, frame.output_counts)
            ids = from_column(frame.req_ids, REQ_ID_DTYPE).tolist()
            for req_id, row, reason, stat in zip(ids, rows, reasons, stats):
                out.tokens.setdefault(req_id, []).extend(row)
                out.first_step.setdefault(req_id, step)
                out.last_step[req_id] = step
                if stat is not None:
                    out.stats[req_id] = stat
                if isinstance(reason, FinishAbort):
                    out.aborts[req_id] = reason
    return out


def solo(checkpoint: tuple[Path, dict[str, Path]], name: str | None) -> list[int]:
    s = scheduler(checkpoint)
    submit(s, 1, ref(s, name))
    return run(s).tokens[1]


def test_mixed_adapters_and_base_give_each_request_its_solo_tokens(
    checkpoint: tuple[Path, dict[str, Path]],
) -> None:
    alone = {name: solo(checkpoint, name) for name in ("a", "b", None)}
    assert len({tuple(t) for t in alone.values()}) == 3, "each adapter changes the output"
    s = scheduler(checkpoint)
    names = ["a", "b", None] * 4
    for i, name in enumerate(names):
        submit(s, i + 1, ref(s, name))
    got = run(s)
    assert not got.aborts
    for i, name in enumerate(names):
        assert got.tokens[i + 1] == alone[name], (i, name)
    assert s.runner.lora is not None and s.runner.lora.slots.pins(0) == 0  # all released


def test_more_adapters_than_slots_wait_outside_the_queue_and_are_reported(
    checkpoint: tuple[Path, dict[str, Path]],
) -> None:
    alone = {name: solo(checkpoint, name) for name in ("a", "b")}
    s = scheduler(checkpoint, max_loras=1)
    for i in range(3):
        submit(s, i + 1, ref(s, "a"), max_new=12)
    submit(s, 4, ref(s, "b"))
    submit(s, 5, None)  # the base needs no slot: it never waits for one
    assert len(s.loras) == 1 and s.num_waiting == 5
    report = SchedulerStatsReporter(s).report(time.time())
    assert report.max_loras == 1 and [a.name for a in report.lora_adapters] == ["a", "b"]
    assert report.waiting_lora_adapters == ("a", "b")
    got = run(s)
    assert got.tokens[4] == alone["b"] and got.tokens[1][:8] == alone["a"]
    # b's request started only once every a request had finished and freed the one slot.
    assert got.first_step[4] > max(got.last_step[i] for i in (1, 2, 3))
    assert got.first_step[5] <= got.first_step[1]


def test_a_retracted_request_keeps_its_adapter(
    checkpoint: tuple[Path, dict[str, Path]],
) -> None:
    alone = {name: solo(checkpoint, name) for name in ("a", "b", None)}
    # 6 requests of 40 + 8 tokens do not fit 160 slots: some are retracted and re-prefilled.
    s = scheduler(checkpoint, max_total_tokens=160)
    names = ["a", "b", None] * 2
    for i, name in enumerate(names):
        submit(s, i + 1, ref(s, name))
    got = run(s)
    assert sum(stat.num_retractions for stat in got.stats.values()) > 0
    for i, name in enumerate(names):
        assert got.tokens[i + 1] == alone[name], (i, name)


def test_the_prefix_cache_is_keyed_by_adapter(checkpoint: tuple[Path, dict[str, Path]]) -> None:
    s = scheduler(checkpoint)
    for req_id, name in enumerate(["a", "a", "b", None, "b"], start=1):
        submit(s, req_id, ref(s, name))
        got = run(s)  # one at a time: each finds what the ones before it cached
        cached = got.stats[req_id].cached_tokens
        assert (cached > 0) == (req_id in (2, 5)), (req_id, name, cached)


def test_an_unloaded_adapter_refuses_new_requests_and_a_reload_is_a_new_namespace(
    checkpoint: tuple[Path, dict[str, Path]],
) -> None:
    s = scheduler(checkpoint)
    lora = s.runner.lora
    assert lora is not None
    old = ref(s, "a")
    submit(s, 1, old)
    s.step()  # running on a
    answer = lora_control(lora, UnloadLoraControl(control_id=1, name="a"))
    assert answer.ok and [a.name for a in answer.adapters] == ["b"]
    submit(s, 2, old)
    got = run(s)
    # It finished on its adapter (its first token went out in the step above).
    assert 1 not in got.aborts and len(got.tokens[1]) == 7
    assert got.aborts[2].status_code == 400 and "no longer loaded" in got.aborts[2].message
    path = checkpoint[1]["a"]
    again = lora_control(lora, LoadLoraControl(control_id=2, name="a", path=str(path)))
    assert again.ok and old is not None and again.adapters[-1].id != old.id
    submit(s, 3, ref(s, "a"))
    got = run(s)
    assert got.stats[3].cached_tokens == 0  # the old load's KV is not this one's
    missing = lora_control(lora, UnloadLoraControl(control_id=3, name="nope"))
    assert not missing.ok and missing.status_code == 404


def test_an_adapter_whose_files_went_away_fails_its_requests_not_the_scheduler(
    checkpoint: tuple[Path, dict[str, Path]], tmp_path: Path
) -> None:
    copy = shutil.copytree(checkpoint[1]["b"], tmp_path / "b-copy")
    s = scheduler(checkpoint, max_loras=1, max_cpu_loras=1)
    lora = s.runner.lora
    assert lora is not None
    assert lora_control(lora, LoadLoraControl(control_id=1, name="c", path=str(copy))).ok
    shutil.rmtree(copy)
    # Loading "a" into the one slot evicts c's host copy; c must then be read from disk.
    submit(s, 1, ref(s, "a"))
    submit(s, 2, ref(s, "c"))
    submit(s, 3, None)
    got = run(s)
    assert len(got.tokens[1]) == 8 and len(got.tokens[3]) == 8
    assert str(copy) in got.aborts[2].message, got.aborts[2]


def test_an_adapter_named_at_start_that_cannot_be_served_fails_the_start_with_why(
    tmp_path: Path,
) -> None:
    config = ServerConfig(
        device="cpu", torch_threads=1, max_total_tokens=256, lora_modules=(f"x={tmp_path}",)
    )
    with pytest.raises(SystemExit, match=r"--lora-modules/--lora-paths: Loading lora x failed"):
        build_or_exit(config)


def test_speculation_with_adapters_changes_no_token(
    checkpoint: tuple[Path, dict[str, Path]],
) -> None:
    """The verify pass carries each row's adapter: n-gram drafts over mixed adapters and the
    base give the tokens plain decoding gives (prompts that repeat, so drafts are made)."""
    spec = (
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, '
        '"prompt_lookup_max": 3, "disable_by_batch_size": 0}'
    )
    prompts = [[40 + (7 * i + j) % 5 for j in range(30)] for i in range(6)]
    names = ["a", "b", None] * 2
    runs = []
    for flags in ({}, {"speculative_config": spec}):
        s = scheduler(checkpoint, **flags)
        for i, (name, prompt) in enumerate(zip(names, prompts)):
            submit(s, i + 1, ref(s, name), prompt=prompt, max_new=24)
        runs.append(run(s))
        drafted = s.mode.spec_counters.num_draft_tokens
    plain, speculating = runs
    assert drafted > 0
    assert speculating.tokens == plain.tokens
    assert sum(stat.spec_accepted_tokens for stat in speculating.stats.values()) > 0
