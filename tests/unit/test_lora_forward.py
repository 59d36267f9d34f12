"""Adapter rows through ``ModelRunner`` (a prefill, then decode passes over the running
batch) against peft's own model of each adapter, for every served family: three adapters of
different ranks and targets and the base, each alone and all four in one batch, give peft's
log-softmax within 1e-4. A base row of a mixed batch is the base model's bit for bit, and
under deterministic inference every row is the same bits alone and mixed."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.config import ServerConfig
from pipeline.tokenizer_loader import SHIPPED_VOCAB_SIZE
from scheduler_proc.model.llama import LlamaDecoderLayer
from scheduler_proc.model.runner import ModelRunner
from tests.hf_checkpoints import CASES, write_case
from tests.lora_adapters import peft_reference, write_adapter

MAX_RANK = 8
# name -> write_adapter's arguments: ranks 8, 4 and 2; every projection, three of them
# (rsLoRA), and the attention of one layer.
ADAPTERS: dict[str, dict[str, Any]] = {
    "all": {"rank": 4, "alpha": 8, "seed": 1},
    "some-rslora": {
        "rank": 8,
        "alpha": 16,
        "seed": 2,
        "target_modules": ("q_proj", "v_proj", "down_proj"),
        "use_rslora": True,
    },
    "one-layer": {
        "rank": 2,
        "alpha": 4,
        "seed": 3,
        "target_modules": ("q_proj", "k_proj", "v_proj", "o_proj"),
        "layers": [1],
    },
}
PROMPT_LENS = (7, 5, 9, 6)  # one row per adapter, then the base
DECODE_STEPS = 3


@dataclass
class Rig:
    """A runner with every adapter pinned in its own slot, and the join numbers of its
    running-batch rows (a row's dense KV copy is trusted only for its own join number)."""

    runner: ModelRunner
    slots: dict[str | None, int]  # adapter name (None: base) -> LoRA slot
    joins: Iterator[int] = field(default_factory=itertools.count)

    def logprobs(self, rows: Sequence[tuple[list[int], str | None]]) -> list[torch.Tensor]:
        """Log-softmax at every position of each (tokens, adapter) row, all rows in one
        batch: the prompts in one extend pass, then ``DECODE_STEPS`` decode passes."""
        runner = self.runner
        lora_slots = [self.slots[name] for _, name in rows]
        ids = [tokens for tokens, _ in rows]
        kv = [runner.kv.alloc(len(tokens)) for tokens in ids]
        assert all(s is not None for s in kv)
        slots = [s for s in kv if s is not None]
        prompts = [len(tokens) - DECODE_STEPS for tokens in ids]
        _, hidden = runner.extend(
            [t[:p] for t, p in zip(ids, prompts)],
            [s[:0] for s in slots],
            [s[:p] for s, p in zip(slots, prompts)],
            return_hidden=True,
            lora_slots=lora_slots,
        )
        assert hidden is not None
        out = list(torch.log_softmax(runner.logits(hidden), -1).split(prompts))
        width = max(len(t) for t in ids)
        table = torch.zeros((len(ids), width), dtype=torch.long)
        for b, s in enumerate(slots):
            table[b, : len(s)] = s
        joined = np.array([next(self.joins) for _ in ids], dtype=np.int64)
        for step in range(DECODE_STEPS):
            seq_lens = np.array([p + step + 1 for p in prompts], dtype=np.int64)
            last = np.array([t[n - 1] for t, n in zip(ids, seq_lens)], dtype=np.int64)
            logits = runner.decode(
                last, seq_lens, table, joined, lora_slots=np.array(lora_slots, dtype=np.int64)
            )
            for b, row in enumerate(torch.log_softmax(logits, -1)):
                out[b] = torch.cat([out[b], row[None]])
        for s in slots:
            runner.kv.free(s)
        return out


@dataclass
class Family:
    base: Path
    adapters: dict[str, Path]
    expected: dict[str | None, torch.Tensor]  # peft's log-softmax of each row's tokens
    tokens: dict[str | None, list[int]]
    rigs: dict[bool, Rig]  # by deterministic

    def rows(self) -> list[tuple[list[int], str | None]]:
        return [(self.tokens[name], name) for name in self.tokens]


def make_rig(
    base: Path, adapters: dict[str, Path], deterministic: bool, *, reverse: bool = False
) -> Rig:
    config = ServerConfig(
        model_path=str(base),
        device="cpu",
        max_total_tokens=256,
        lora_modules=tuple(f"{name}={path}" for name, path in adapters.items()),
        max_loras=len(adapters),
        max_lora_rank=MAX_RANK,
        enable_deterministic_inference=deterministic,
    )
    runner = ModelRunner(config, SHIPPED_VOCAB_SIZE)
    assert runner.lora is not None
    registry, slots = runner.lora.registry, runner.lora.slots
    pinned: dict[str | None, int] = {None: -1}
    for adapter in reversed(registry.adapters()) if reverse else registry.adapters():
        slot = slots.acquire(adapter, registry.weights)
        assert slot is not None
        pinned[adapter.name] = slot
    return Rig(runner, pinned)


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    root = tmp_path_factory.mktemp(request.param)
    reference = write_case(root / "base", request.param)
    adapters = {
        name: write_adapter(root / "base", root / name, **kw) for name, kw in ADAPTERS.items()
    }
    gen = torch.Generator().manual_seed(7)
    names: list[str | None] = [*ADAPTERS, None]
    tokens = {
        name: torch.randint(0, SHIPPED_VOCAB_SIZE, (n + DECODE_STEPS,), generator=gen).tolist()
        for name, n in zip(names, PROMPT_LENS)
    }
    expected = {}
    with torch.no_grad():
        for name in names:
            model = reference if name is None else peft_reference(root / "base", adapters[name])
            logits = model(torch.tensor([tokens[name]])).logits[0].float()
            expected[name] = torch.log_softmax(logits, -1)
    rigs = {det: make_rig(root / "base", adapters, det) for det in (False, True)}
    return Family(root / "base", adapters, expected, tokens, rigs)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_each_adapter_alone_and_mixed_equals_peft(family: Family, deterministic: bool) -> None:
    rig = family.rigs[deterministic]
    mixed = rig.logprobs(family.rows())
    for (_, name), got in zip(family.rows(), mixed):
        torch.testing.assert_close(got, family.expected[name], atol=1e-4, rtol=0, msg=name)
        alone = rig.logprobs([(family.tokens[name], name)])[0]
        torch.testing.assert_close(alone, family.expected[name], atol=1e-4, rtol=0, msg=name)
        if deterministic:
            assert torch.equal(alone, got), name


def test_deterministic_rows_do_not_depend_on_their_slot(family: Family) -> None:
    """The stacked width is fixed and the other slots' columns are exact zeros, so an
    adapter copied into another slot (a later request's) gives the same bits."""
    rig = family.rigs[True]
    moved = make_rig(family.base, family.adapters, True, reverse=True)
    assert [moved.slots[name] for name in ADAPTERS] != [rig.slots[name] for name in ADAPTERS]
    for name in ADAPTERS:
        row = [(family.tokens[name], name)]
        assert torch.equal(moved.logprobs(row)[0], rig.logprobs(row)[0]), name


def test_the_adapters_change_the_output(family: Family) -> None:
    """The equalities above prove something only if each adapter moves the logprobs."""
    base = family.expected[None]
    rig = family.rigs[False]
    for name in ADAPTERS:
        as_base = rig.logprobs([(family.tokens[name], None)])[0]
        assert (as_base - family.expected[name]).abs().max() > 1e-2, name
    assert base.shape[0] == PROMPT_LENS[-1] + DECODE_STEPS


def test_a_base_row_of_a_mixed_batch_is_the_base_models_bits(family: Family) -> None:
    """Its mask row is zeros, so its delta is exact zeros: the same batch with no adapter
    at all (a pass that does no LoRA work) gives the same bits in every row of the base."""
    rig = family.rigs[False]
    rows = family.rows()
    mixed = rig.logprobs(rows)
    base_only = rig.logprobs([(tokens, None) for tokens, _ in rows])
    assert torch.equal(mixed[-1], base_only[-1])
    assert rig.runner.lora is not None
    assert rig.runner.lora.pass_for(np.array([-1, -1])) is None


def test_a_reused_slot_holds_only_its_new_adapter(family: Family) -> None:
    """One slot: an adapter waits (None) while another pins it, then takes it over once
    released; what it leaves untargeted (every projection but four of one layer) is zeros
    again, so the row is peft's model of the new adapter alone."""
    runner = ModelRunner(
        ServerConfig(
            model_path=str(family.base),
            device="cpu",
            max_total_tokens=256,
            lora_modules=tuple(f"{n}={p}" for n, p in family.adapters.items()),
            max_loras=1,
            max_lora_rank=MAX_RANK,
        ),
        SHIPPED_VOCAB_SIZE,
    )
    assert runner.lora is not None
    registry, slots = runner.lora.registry, runner.lora.slots
    first, _, last = registry.adapters()
    assert slots.acquire(first, registry.weights) == 0
    assert slots.acquire(last, registry.weights) is None
    assert slots.acquire(first, registry.weights) == 0 and slots.pins(0) == 2
    slots.release(first.id)
    assert slots.acquire(last, registry.weights) is None
    slots.release(first.id)
    assert slots.acquire(last, registry.weights) == 0
    assert slots.slot_of(first.id) is None and slots.slot_of(last.id) == 0
    rig = Rig(runner, {last.name: 0})
    got = rig.logprobs([(family.tokens[last.name], last.name)])[0]
    torch.testing.assert_close(got, family.expected[last.name], atol=1e-4, rtol=0)


def test_slot_buffers_are_not_weights(family: Family) -> None:
    """Checkpoints (``save_pretrained`` writes the state dict), weight loads and weight
    updates (they walk the parameters) see what a model without slots has, nothing more."""
    model = family.rigs[False].runner.model
    plain = type(model)(model.config, "cpu")
    layer = model.model.layers[0]
    assert isinstance(layer, LlamaDecoderLayer) and layer.self_attn.q_proj.lora_a is not None
    assert model.state_dict().keys() == plain.state_dict().keys()
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in plain.named_parameters()]


def test_a_runner_without_lora_has_no_slots(family: Family) -> None:
    runner = ModelRunner(
        ServerConfig(model_path=str(family.base), device="cpu", max_total_tokens=64),
        SHIPPED_VOCAB_SIZE,
    )
    layer = runner.model.model.layers[0]
    assert runner.lora is None
    assert isinstance(layer, LlamaDecoderLayer) and layer.mlp.down_proj.lora_a is None


def test_a_pass_reads_the_slots_up_to_its_highest_in_use_unless_deterministic(
    family: Family,
) -> None:
    for deterministic, rig in family.rigs.items():
        lora = rig.runner.lora
        assert lora is not None
        slots = lora.slots
        for used in range(slots.num_slots):
            mask = slots.pass_for(torch.tensor([-1, used, 0])).mask
            width = slots.num_slots if deterministic else used + 1
            assert mask.shape == (3, width * slots.max_rank), (deterministic, used)
            assert not bool(mask[0].any())  # the base row reads nothing
