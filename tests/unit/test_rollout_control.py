"""The rollout controls driven in-process between a real scheduler's steps
(scheduler_proc/rollout.py): what each pause mode does to the queues and the KV, the wait
that answers once drained, the update's safe point, and a checkpoint that does not fit."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest

from pipeline.config import ServerConfig
from pipeline.control_frames import (
    ContinueControl,
    PauseControl,
    PauseMode,
    RolloutState,
    UpdateWeightsControl,
)
from scheduler_proc.main import build_scheduler
from scheduler_proc.model.weight_update import config_differences
from scheduler_proc.scheduler import Scheduler
from tests.unit.test_scheduler_steps import PROMPT, assert_no_kv_leak, submit


def make() -> Scheduler:
    return build_scheduler(ServerConfig(max_total_tokens=4096, torch_threads=1))


def pause(s: Scheduler, mode: PauseMode) -> list[RolloutState]:
    return s.rollout.pause(s, PauseControl(control_id=1, mode=mode), time.time())


def step_until_answered(s: Scheduler, limit: int = 200) -> list[RolloutState]:
    """Steps until ``Rollout.advance`` answers something; those answers."""
    for _ in range(limit):
        s.step()
        answers = s.rollout.advance(s)
        if answers:
            return answers
    raise AssertionError("no answer")


def test_retract_frees_every_request_kv_and_no_step_runs_until_continue() -> None:
    s = make()
    for i in range(3):
        submit(s, i, PROMPT[i * 10 : i * 10 + 40], max_new=30)
    for _ in range(4):
        s.step()
    assert s.num_running == 3
    (answer,) = pause(s, "retract")
    assert answer.ok and answer.paused == "retract" and answer.num_paused_requests == 3
    assert s.num_running == 0 and len(s.waiting) == 3
    assert [r.req_id for r in s.waiting] == [0, 1, 2]  # their order kept
    assert all(r.retraction_count == 1 for r in s.waiting)
    assert s.kv_tokens_held_by_requests == 0
    steps = s.forward_steps
    assert not s.has_work()  # the loop sleeps on its sockets
    assert s.step() == [] and s.forward_steps == steps
    s.rollout.resume(s, ContinueControl(control_id=2))
    while s.has_work():
        s.step()
    assert_no_kv_leak(s)


def test_wait_answers_once_the_running_requests_end_and_admits_none_meanwhile() -> None:
    s = make()
    submit(s, 1, PROMPT[:20], max_new=8)
    s.step()
    assert pause(s, "wait") == []
    submit(s, 2, PROMPT[20:40], max_new=8)
    (answer,) = step_until_answered(s)
    assert answer.ok and answer.control_id == 1 and answer.paused == "wait"
    assert not s.rollout.runs_steps
    assert [r.req_id for r in s.waiting] == [2]  # queued, never admitted
    assert 1 not in s.live


def test_paused_seconds_count_only_while_no_step_runs() -> None:
    s = make()
    assert s.rollout.paused_seconds_total() == 0.0
    pause(s, "in_place")
    time.sleep(0.05)
    pause(s, "retract")  # another mode while paused: still one pause
    s.rollout.resume(s, ContinueControl(control_id=3))
    total = s.rollout.paused_seconds_total()
    assert total >= 0.05
    time.sleep(0.02)
    assert s.rollout.paused_seconds_total() == total


def test_an_update_waits_for_a_safe_point_and_a_second_is_refused(tmp_path: Path) -> None:
    s = make()
    s.runner.model.save_pretrained(tmp_path / "same")
    submit(s, 1, PROMPT[:20], max_new=20)
    s.step()
    msg = UpdateWeightsControl(control_id=5, model_path=str(tmp_path / "same"), weight_version="v2")
    assert s.rollout.update_weights(s, msg) is None
    second = s.rollout.update_weights(s, msg)
    assert second is not None and not second.ok and "in progress" in second.message
    (answer,) = step_until_answered(s)
    assert answer.ok and answer.weight_version == "v2"
    assert 1 not in s.live  # swapped once it ended
    assert s.rollout.weight_version == "v2" and not s.rollout.busy
    assert s.rollout.counters.updates_ok == 1


@pytest.mark.parametrize(
    ("change", "named"),
    [({"intermediate_size": 256}, "intermediate_size: 256"), ({"qk_norm": True}, "qk_norm")],
)
def test_config_differences_name_each_field(change: dict[str, object], named: str) -> None:
    import dataclasses

    served = make().runner.model.config
    assert config_differences(served, served) == []
    other = dataclasses.replace(served, **change)  # type: ignore[arg-type]
    assert any(named in d for d in config_differences(served, other))
    assert config_differences(served, dataclasses.replace(served, dtype="bfloat16")) == []


def test_hicache_storage_never_serves_the_old_weights_kv(tmp_path: Path) -> None:
    """A prompt stored under A, then computed under B and stored again, comes back from
    storage as B's KV: stored keys of the new weights differ from the old ones' (a key
    names its content, and a write of a known key is skipped)."""
    from tests.e2e.test_hicache import PROMPTS as LONG, SUFFIX, hicache_scheduler, serve_one

    b_dir = tmp_path / "B"
    b_config = ServerConfig(max_total_tokens=4096, chunked_prefill_size=64, torch_threads=1)
    b = build_scheduler(msgspec.structs.replace(b_config, model_seed=1))
    b.runner.model.save_pretrained(b_dir)
    want, _ = serve_one(b, 1, LONG[0] + SUFFIX)
    (tmp_path / "store").mkdir()
    s = hicache_scheduler(host=128, storage=tmp_path / "store")
    # One token each: what is cached is the prompt alone, the same segments under A and B.
    for j in range(4):  # the host tier holds one prefix: the first goes on to storage
        serve_one(s, j + 1, LONG[j], max_new=1)
    msg = UpdateWeightsControl(control_id=7, model_path=str(b_dir))
    assert s.rollout.update_weights(s, msg) is None
    while not s.rollout.advance(s):
        time.sleep(0.01)
    for j in range(4):  # computed under B, and down to storage again
        _, stats = serve_one(s, 20 + j, LONG[j], max_new=1)
        assert stats.cached_tokens == 0  # type: ignore[attr-defined]
    tokens, stats = serve_one(s, 30, LONG[0] + SUFFIX)
    assert stats.cached_tokens_details.storage == 100  # type: ignore[attr-defined]
    assert tokens == want
