"""``--op-groups``: the decode forward split by op group, in the benchmark process only.

``GROUPS`` is the one table of what is hooked: each group names its targets, submodules of the
model (by class and attribute name) or callables looked up by name at each call (a module's
function, a class's method). A call's own time (less that of the hooked calls inside it) is
its group's; ``other`` is the hooked forward less the groups. A ``region`` group (a fused or
compiled callable) keeps the hooked calls inside it as its own. Every name is checked before a
step runs: a changed model raises, never measures nothing. A group whose hooks fire fewer
times than a forward calls it ran where they cannot see (compiled code): it prints as not
seen, its time in the column of the hooked call around it or in ``other``.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bench.scheduler_step_timers import Timer
from bench.scheduler_step_workload import decode_step
from scheduler_proc.model.llama import LlamaForCausalLM
from scheduler_proc.scheduler import Scheduler

LLAMA = "scheduler_proc.model.llama"
ATTENTION = "scheduler_proc.model.attention"
HERE = "bench/scheduler_step_ops.py"
# Steps per block of one arm; the arms (hooks in, hooks out) alternate block by block.
OP_BLOCK = 5
ARMS = ("plain", "hooked")
# Each arm's figures are means over its fastest steps, this share of them (by forward time):
# a step the other processes' load held up would charge its stall to whichever op it hit.
KEPT = 0.75


@dataclass(frozen=True)
class Modules:
    """The model's submodules of class ``cls`` (a class of llama.py); only those whose
    attribute name is in ``names`` when it is given. Each runs once a forward."""

    cls: str
    names: tuple[str, ...] = ()


@dataclass(frozen=True)
class Function:
    """A callable the model looks up by name at each call: ``path`` in module ``module``, a
    function (``apply_rotary``) or a class's attribute (``LlamaForCausalLM.logits``). A
    forward calls it ``per_layer`` times in each decoder layer and ``per_forward`` more."""

    module: str
    path: str
    per_layer: int = 0
    per_forward: int = 0


Target = Modules | Function


@dataclass(frozen=True)
class Group:
    """A column of the op-group table. ``region``: a fused or compiled callable whose inner
    hooked calls are its own time; it may not run at all (its switch is off)."""

    name: str
    what: str
    targets: tuple[Target, ...]
    region: bool = False


# In the order a decode forward runs them. A fused or compiled callable of the decoder joins
# as its own group, e.g. Group("attn_in", "input norm + qkv + rotary", (Function(LLAMA,
# "fused_attn_in", per_layer=1),), region=True): the groups it fuses then print as not seen
# while it runs, and its column holds them.
GROUPS: tuple[Group, ...] = (
    Group("embed", "the token embedding", (Modules("Embedding"),)),
    Group(
        "layout",
        "AttentionLayout.from_batch: rotary rows, masks, the pass's host sync",
        (Function(LLAMA, "AttentionLayout.from_batch", per_forward=1),),
    ),
    Group("norms", "every RMSNorm (layer norms, final norm, q/k norms)", (Modules("RMSNorm"),)),
    Group("qkv", "q_proj, k_proj, v_proj", (Modules("Linear", ("q_proj", "k_proj", "v_proj")),)),
    Group("rotary", "apply_rotary on q and k", (Function(LLAMA, "apply_rotary", per_layer=2),)),
    Group(
        "attn_kv",
        "pool_attention less attn_math: KV write into the pool, KV copy append or gather",
        (Function(LLAMA, "pool_attention", per_layer=1),),
    ),
    Group(
        "attn_math",
        "decode_attention: scores, softmax, weighted sum",
        (Function(ATTENTION, "decode_attention", per_layer=1),),
    ),
    Group("o_proj", "o_proj", (Modules("Linear", ("o_proj",)),)),
    Group("gate_up", "gate_proj, up_proj", (Modules("Linear", ("gate_proj", "up_proj")),)),
    Group("act_mul", "LlamaMLP less its Linears: SiLU(gate) * up", (Modules("LlamaMLP"),)),
    Group("down", "down_proj", (Modules("Linear", ("down_proj",)),)),
    Group(
        "lm_head",
        "LlamaForCausalLM.logits: lm_head and the float32 cast",
        (Function(LLAMA, "LlamaForCausalLM.logits", per_forward=1),),
    ),
)


class GroupClock:
    """Each group's own time and calls. ``enter`` and ``exit`` bracket a hooked call; a call
    inside a region, or traced by torch.compile, is not counted (it has no time of its own
    there)."""

    def __init__(
        self,
        groups: Sequence[Group],
        sync: Callable[[], None] | None = None,
        now: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        self.regions = [g.region for g in groups]
        self.own_ns = [0] * len(groups)
        self.calls = [0] * len(groups)
        self._sync = sync
        self._now = now
        self._stack: list[list[int]] = []  # [group, start ns, ns of the hooked calls inside]
        self._muted = 0  # calls entered inside a region, not yet exited

    def enter(self, group: int) -> None:
        if torch.compiler.is_compiling():  # traced: a no-op in the graph, never run
            return
        if self._muted or (self._stack and self.regions[self._stack[-1][0]]):
            self._muted += 1
            return
        if self._sync is not None:
            self._sync()
        self._stack.append([group, self._now(), 0])

    def exit(self) -> None:
        if torch.compiler.is_compiling():
            return
        if self._muted:
            self._muted -= 1
            return
        if self._sync is not None:
            self._sync()
        group, start, inner = self._stack.pop()
        elapsed = self._now() - start
        self.own_ns[group] += elapsed - inner
        self.calls[group] += 1
        if self._stack:
            self._stack[-1][2] += elapsed

    def take(self) -> tuple[list[int], list[int]]:
        """The own ns and calls of each group since the last take."""
        taken = (self.own_ns, self.calls)
        self.own_ns, self.calls = [0] * len(self.regions), [0] * len(self.regions)
        return taken


def resolve(target: Function) -> tuple[Any, str, Any]:
    """(owner, attribute, the value in the owner's ``__dict__``) of a named callable; raises
    LookupError if a name is gone."""
    try:
        owner: Any = importlib.import_module(target.module)
        *parents, attribute = target.path.split(".")
        for part in parents:
            owner = getattr(owner, part)
        raw = vars(owner)[attribute]
    except (ImportError, AttributeError, KeyError) as exc:
        raise LookupError(f"{target.module} has no {target.path}") from exc
    if not (callable(raw) or isinstance(raw, (classmethod, staticmethod))):
        raise LookupError(f"{target.module}.{target.path} is not callable")
    return owner, attribute, raw


def find_modules(model: nn.Module, target: Modules) -> list[nn.Module]:
    """The submodules ``target`` names; raises LookupError if its class is gone or none
    matches."""
    cls = getattr(importlib.import_module(LLAMA), target.cls, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise LookupError(f"{LLAMA} has no module class {target.cls}")
    found: list[nn.Module] = []
    for name, module in model.named_modules():
        if isinstance(module, cls) and (not target.names or name.split(".")[-1] in target.names):
            found.append(module)
    if not found:
        names = f" named {', '.join(target.names)}" if target.names else ""
        raise LookupError(f"the model has no {target.cls}{names}")
    return found


class OpHooks:
    """The hooks of ``groups`` on one model, every name checked here (a RuntimeError lists
    the missing ones). ``installed()`` puts them in place for a block of steps."""

    def __init__(
        self, model: LlamaForCausalLM, groups: Sequence[Group], sync: Callable[[], None] | None
    ) -> None:
        self.groups = tuple(groups)
        self.clock = GroupClock(groups, sync)
        self.expected = [0] * len(groups)  # calls a forward makes to each group
        self._modules: list[tuple[nn.Module, int]] = []
        self._swaps: list[tuple[Any, str, Any, Any]] = []  # owner, attribute, raw, wrapper
        layers = model.config.num_hidden_layers
        problems: list[str] = []
        for i, group in enumerate(groups):
            for target in group.targets:
                try:
                    self.expected[i] += self._add(model, i, target, layers)
                except LookupError as exc:
                    problems.append(f"{group.name}: {exc}")
        if problems:
            raise RuntimeError(
                f"--op-groups: {'; '.join(problems)}; the model changed: update GROUPS in {HERE}"
            )
        # One pair of hook functions for every install: the same objects each block.
        self._pre = [self._pre_hook(i) for i in range(len(groups))]

    def _add(self, model: nn.Module, group: int, target: Target, layers: int) -> int:
        if isinstance(target, Modules):
            found = find_modules(model, target)
            self._modules += [(module, group) for module in found]
            return len(found)
        owner, attribute, raw = resolve(target)
        self._swaps.append((owner, attribute, raw, self._wrapper(group, owner, attribute, raw)))
        return target.per_layer * layers + target.per_forward

    def _wrapper(self, group: int, owner: Any, attribute: str, raw: Any) -> Any:
        clock = self.clock
        # A class's classmethod or staticmethod is called through its bound form, and the
        # wrapper must not bind; a plain function binds as the original did.
        fn = getattr(owner, attribute) if isinstance(raw, (classmethod, staticmethod)) else raw

        def timed(*args: Any, **kwargs: Any) -> Any:
            clock.enter(group)
            try:
                return fn(*args, **kwargs)
            finally:
                clock.exit()

        return staticmethod(timed) if isinstance(raw, (classmethod, staticmethod)) else timed

    def _pre_hook(self, group: int) -> Callable[[nn.Module, Any], None]:
        def pre(module: nn.Module, args: Any) -> None:
            self.clock.enter(group)

        return pre

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        self.clock.exit()

    @contextmanager
    def installed(self) -> Iterator[None]:
        handles = []
        for module, group in self._modules:
            handles.append(module.register_forward_pre_hook(self._pre[group]))
            handles.append(module.register_forward_hook(self._post_hook))
        # setattr: swapping a module's function or a class's method is the point here.
        for owner, attribute, _, wrapper in self._swaps:
            setattr(owner, attribute, wrapper)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for owner, attribute, raw, _ in self._swaps:
                setattr(owner, attribute, raw)


def op_decode_steps(steps: int) -> int:
    """The decode steps ``measure_op_groups`` runs for ``steps`` a side."""
    blocks = -(-steps // OP_BLOCK)
    return 2 * (steps + blocks)


@dataclass(frozen=True)
class OpStep:
    """One timed decode step of an arm: its forward and each group's own time and calls."""

    forward_ns: int
    own_ns: list[int]
    calls: list[int]


def measure_op_groups(
    scheduler: Scheduler,
    batch_size: int,
    steps: int,
    forward: Timer,
    groups: Sequence[Group] = GROUPS,
) -> dict[str, Any]:
    """``steps`` decode steps with the hooks in and ``steps`` without, in alternating blocks
    of ``OP_BLOCK`` (each after one untimed step: a switch may recompile or chill caches);
    ``forward`` is the timer on ``model.forward``. Returns each arm's forward and each
    group's own time and calls, per forward, over the arm's fastest ``KEPT`` steps."""
    if steps < 1:
        raise ValueError("--op-steps must be >= 1")
    runner = scheduler.runner
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else None
    hooks = OpHooks(runner.model, groups, sync)
    arms: dict[str, list[OpStep]] = {arm: [] for arm in ARMS}
    while len(arms["hooked"]) < steps:
        block = min(OP_BLOCK, steps - len(arms["hooked"]))
        for arm in ARMS:
            with hooks.installed() if arm == "hooked" else nullcontext():
                decode_step(scheduler, batch_size)
                forward.take()
                hooks.clock.take()
                arms[arm] += [op_step(scheduler, batch_size, forward, hooks) for _ in range(block)]
    return op_result(hooks.groups, hooks.expected, arms)


def op_step(scheduler: Scheduler, batch_size: int, forward: Timer, hooks: OpHooks) -> OpStep:
    """A decode step, which must run exactly one forward."""
    start = forward.calls
    decode_step(scheduler, batch_size)
    if forward.calls != start + 1:
        raise RuntimeError(f"a decode step ran {forward.calls - start} forwards, not one")
    return OpStep(forward.take(), *hooks.clock.take())


def fastest(steps: list[OpStep]) -> list[OpStep]:
    return sorted(steps, key=lambda step: step.forward_ns)[: max(1, round(KEPT * len(steps)))]


def op_result(
    groups: Sequence[Group], expected: Sequence[int], arms: dict[str, list[OpStep]]
) -> dict[str, Any]:
    """Each arm's mean forward and the hooked arm's groups, over each arm's fastest steps;
    ``expected``: the calls a forward makes to each group."""
    plain, hooked = fastest(arms["plain"]), fastest(arms["hooked"])
    n = len(hooked)
    hooked_ms = sum(step.forward_ns for step in hooked) / 1e6 / n
    rows: list[dict[str, Any]] = [
        {
            "name": group.name,
            "what": group.what,
            "ms": sum(step.own_ns[i] for step in hooked) / 1e6 / n,
            "calls": sum(step.calls[i] for step in hooked),
            "expected": expected[i] * n,
            "region": group.region,
        }
        for i, group in enumerate(groups)
    ]
    return {
        "steps": len(arms["hooked"]),
        "kept": n,
        "fwd_ms": sum(step.forward_ns for step in plain) / 1e6 / len(plain),
        "hooked_ms": hooked_ms,
        "groups": rows,
        "other_ms": hooked_ms - sum(row["ms"] for row in rows),
    }


def seen(row: dict[str, Any]) -> str:
    """``all``, ``none`` or ``part`` of the calls a forward makes to the group."""
    if row["calls"] == row["expected"]:
        return "all"
    return "none" if row["calls"] == 0 else "part"


def row_label(row: dict[str, Any]) -> str:
    return f"{row['batch_size']:>6d}{row['sampling']:>10}{row['threads']:>8d}"


def lead_header() -> str:
    return f"{'batch':>6}{'sampling':>10}{'threads':>8}"


def format_op_groups(results: Sequence[dict[str, Any]]) -> list[str]:
    """Two tables of the rows that have op groups: ms a step, then % of the hooked forward;
    then what each column holds and a note on every group the hooks did not fully see."""
    rows = [r for r in results if "op_groups" in r]
    if not rows:
        return []
    first = rows[0]["op_groups"]
    names = [g["name"] for g in first["groups"]]
    columns = "".join(f"{name:>10}" for name in [*names, "other"])
    lines = [
        "",
        f"forward by op group (--op-groups): {first['steps']} decode steps with the hooks and "
        f"{first['steps']} without, in alternating blocks of {OP_BLOCK}; means over each arm's "
        f"fastest {first['kept']} (spikes of the other processes' load fall out); each group's "
        "own time (hooked calls inside it are theirs), other = the hooked forward less the groups",
        "",
        "ms a step: fwd_ms the forward without the hooks, hooked with them, hooks_% their cost",
        lead_header() + f"{'fwd_ms':>9}{'hooked':>9}{'hooks_%':>8}" + columns,
    ]
    for r in rows:
        op = r["op_groups"]
        cost = 100.0 * (op["hooked_ms"] / op["fwd_ms"] - 1.0)
        lead = f"{op['fwd_ms']:>9.3f}{op['hooked_ms']:>9.3f}{cost:>8.1f}"
        lines.append(row_label(r) + lead + op_cells(op, percent=False))
    lines += ["", "% of the hooked forward", lead_header() + columns]
    lines += [row_label(r) + op_cells(r["op_groups"], percent=True) for r in rows]
    return [*lines, "", *group_help(rows[0]), *unseen_notes(rows)]


def op_cells(op: dict[str, Any], *, percent: bool) -> str:
    """Each group's ms a step (or % of the hooked forward), ``-`` where the hooks saw none
    of its calls; then other's."""
    scale = 100.0 / op["hooked_ms"] if percent else 1.0
    shown = "{:>10.1f}" if percent else "{:>10.3f}"
    figures = [
        shown.format(g["ms"] * scale) if seen(g) != "none" else f"{'-':>10}" for g in op["groups"]
    ]
    return "".join(figures) + shown.format(op["other_ms"] * scale)


def group_help(row: dict[str, Any]) -> list[str]:
    parts = [f"{g['name']}: {g['what']}" for g in row["op_groups"]["groups"]]
    return ["; ".join([*parts, "other: residual adds, reshapes, h[last], the hooks' own cost"])]


def unseen_notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """A line per row with a group the hooks did not fully see (a region's switch off is not
    news: it did not run)."""
    notes = []
    for r in rows:
        missing = [
            f"{g['name']} ({g['calls']} of {g['expected']} calls)"
            for g in r["op_groups"]["groups"]
            if seen(g) != "all" and not (g["region"] and g["calls"] == 0)
        ]
        if missing:
            notes.append(
                f"B={r['batch_size']} {r['sampling']} threads {r['threads']}: not seen: "
                f"{', '.join(missing)}: they ran where the hooks cannot see (inside a compiled "
                "or fused region, or off this path); their time is in the column of the hooked "
                "call around them, or in other"
            )
    return notes
