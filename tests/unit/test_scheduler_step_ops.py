"""``bench/scheduler_step.py --op-groups`` (bench/scheduler_step_ops.py): the hooks charge each
call its own time, see every call a decode forward makes to each group of the real model, leave
nothing hooked behind, keep a region's inner calls as its own and say which groups they could
not see, and refuse a table that names what the model no longer has. Timings are not judged."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from bench.scheduler_step_ops import (
    ATTENTION,
    GROUPS,
    LLAMA,
    Function,
    Group,
    GroupClock,
    Modules,
    OpHooks,
    OpStep,
    format_op_groups,
    measure_op_groups,
    op_result,
)
from bench.scheduler_step_run import reach_decoding
from bench.scheduler_step_timers import Timer, instrument
from bench.scheduler_step_workload import build, prompts, submit
from scheduler_proc.model import llama
from scheduler_proc.model.forward_batch import AttentionLayout
from scheduler_proc.scheduler import Scheduler

BATCH = 3


@pytest.fixture(scope="module")
def decoding() -> Iterator[tuple[Scheduler, Timer]]:
    """The built-in model, BATCH requests decoding, and the timer on its forward."""
    scheduler = build(BATCH, 8 + 80, torch_threads=1, device="cpu")
    submit(scheduler, prompts(BATCH, 8, scheduler.vocab_size, 0), 80, "greedy", 0)
    reach_decoding(scheduler, BATCH, bound=10, warmup=1)
    _, forward, _ = instrument(scheduler)
    yield scheduler, forward


def by_name(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {g["name"]: g for g in result["groups"]}


def test_the_clock_charges_each_call_its_own_time() -> None:
    """A call's time less that of the hooked calls inside it; inside a region, inner calls are
    not counted (and do not read the clock)."""
    ticks = iter([0, 2, 5, 10, 20, 30])
    outer = Group("outer", "", ())
    inner = Group("inner", "", ())
    region = Group("region", "", (), region=True)
    clock = GroupClock([outer, inner, region], now=lambda: next(ticks))
    clock.enter(0)  # 0
    clock.enter(1)  # 2
    clock.exit()  # 5: inner 3
    clock.exit()  # 10: outer 10 - 3
    clock.enter(2)  # 20
    clock.enter(1)
    clock.enter(0)
    clock.exit()
    clock.exit()
    clock.exit()  # 30: the region 10, its inner calls its own
    assert clock.take() == ([7, 3, 10], [1, 1, 1])
    assert clock.take() == ([0, 0, 0], [0, 0, 0])


def test_the_figures_are_means_over_each_arms_fastest_steps() -> None:
    """A step the machine's other load held up falls out of both arms, and the groups with
    other add up to the kept steps' mean hooked forward."""
    groups = [Group("a", "", ()), Group("b", "", ())]
    hooked = [
        OpStep(10_000_000, [4_000_000, 1_000_000], [1, 2]),
        OpStep(900_000_000, [800_000_000, 1_000_000], [1, 2]),  # held up: dropped
        OpStep(20_000_000, [6_000_000, 3_000_000], [1, 2]),
        OpStep(30_000_000, [8_000_000, 5_000_000], [1, 2]),
    ]
    plain = [OpStep(ns, [0, 0], [0, 0]) for ns in (9_000_000, 12_000_000, 500_000_000, 15_000_000)]
    result = op_result(groups, [1, 2], {"plain": plain, "hooked": hooked})
    assert result["steps"] == 4 and result["kept"] == 3
    assert result["fwd_ms"] == pytest.approx(12.0)
    assert result["hooked_ms"] == pytest.approx(20.0)
    a, b = result["groups"]
    assert (a["ms"], a["calls"], a["expected"]) == (pytest.approx(6.0), 3, 3)
    assert (b["ms"], b["calls"], b["expected"]) == (pytest.approx(3.0), 6, 6)
    assert result["other_ms"] == pytest.approx(11.0)


def test_every_call_of_a_decode_forward_lands_in_its_group(
    decoding: tuple[Scheduler, Timer],
) -> None:
    scheduler, forward = decoding
    rotary, attention_layout = llama.apply_rotary, vars(AttentionLayout)["from_batch"]
    steps = 3
    result = measure_op_groups(scheduler, BATCH, steps, forward)
    cfg = scheduler.runner.model.config
    layers = cfg.num_hidden_layers
    per_forward = {
        "embed": 1,
        "layout": 1,
        "norms": 2 * layers + 1 + (2 * layers if cfg.qk_norm else 0),
        "qkv": 3 * layers,
        "rotary": 2 * layers,
        "attn_kv": layers,
        "attn_math": layers,
        "o_proj": layers,
        "gate_up": 2 * layers,
        "act_mul": layers,
        "down": layers,
        "lm_head": 1,
    }
    groups = by_name(result)
    assert list(groups) == [g.name for g in GROUPS]
    assert result["steps"] == steps and result["kept"] == 2  # the fastest 3/4, rounded
    for name, calls in per_forward.items():
        assert groups[name]["calls"] == groups[name]["expected"] == calls * 2, name
        assert groups[name]["ms"] > 0, name
    # Own times never overlap: the groups fit inside the hooked forward, other is the rest.
    assert result["other_ms"] >= 0
    # Nothing stays hooked.
    assert llama.apply_rotary is rotary
    assert vars(AttentionLayout)["from_batch"] is attention_layout
    for module in scheduler.runner.model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks


def test_a_region_keeps_its_inner_calls_and_the_table_says_which_were_not_seen(
    decoding: tuple[Scheduler, Timer],
) -> None:
    """The MLP as one region (as a compiled callable would be): its Linears' hooks fire inside
    it and are not counted, so gate_up and down print as not seen; a region that never runs
    (its switch off) prints '-' without a note."""
    scheduler, forward = decoding
    mlp = Group("mlp", "the whole MLP", (Modules("LlamaMLP"),), region=True)
    off = Group("fused_off", "", (Function(ATTENTION, "padded_attention", per_layer=1),), True)
    groups = [mlp if g.name == "act_mul" else g for g in GROUPS] + [off]
    result = measure_op_groups(scheduler, BATCH, 2, forward, groups)
    seen = by_name(result)
    layers = scheduler.runner.model.config.num_hidden_layers
    assert seen["mlp"]["calls"] == layers * result["kept"]
    assert seen["gate_up"]["calls"] == seen["down"]["calls"] == seen["fused_off"]["calls"] == 0
    row = {"batch_size": BATCH, "sampling": "greedy", "threads": 1, "op_groups": result}
    lines = format_op_groups([row])
    header = next(line for line in lines if line.split()[:1] == ["batch"])
    figures = lines[lines.index(header) + 1].split()
    cells = dict(zip(header.split(), figures))
    assert cells["gate_up"] == cells["down"] == cells["fused_off"] == "-"
    assert float(cells["mlp"]) > 0
    notes = [line for line in lines if "not seen" in line]
    assert len(notes) == 1
    assert "gate_up (0 of" in notes[0] and "down (0 of" in notes[0]
    assert "fused_off" not in notes[0]


def test_a_hooked_name_the_model_no_longer_has_raises(decoding: tuple[Scheduler, Timer]) -> None:
    scheduler, _ = decoding
    gone = [
        Group("fused", "", (Function(LLAMA, "fused_norm_qkv_rotary", per_layer=1),)),
        Group("qkv", "", (Modules("Linear", ("qkv_proj",)),)),
        Group("norms", "", (Modules("LayerNorm"),)),
        Group("head", "", (Function(LLAMA, "LlamaForCausalLM.head_logits", per_forward=1),)),
    ]
    with pytest.raises(RuntimeError) as raised:
        OpHooks(scheduler.runner.model, gone, None)
    message = str(raised.value)
    for missing in ("fused_norm_qkv_rotary", "Linear named qkv_proj", "LayerNorm", "head_logits"):
        assert missing in message
    assert "bench/scheduler_step_ops.py" in message
