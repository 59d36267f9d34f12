"""Adapters as peft 0.21 writes them: what is read (rank, scaling, the tensors of the layers
and projections they change) and what is refused, naming the key and the path; and the
registry's ids, host copies and vLLM's wording for load and unload."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.config import ServerConfig
from pipeline.model_config import ModelConfig
from pipeline.tokenizer_loader import SHIPPED_VOCAB_SIZE
from scheduler_proc.lora.adapter_files import (
    CONFIG_FILE,
    PROJECTIONS,
    WEIGHTS_FILE,
    LoraError,
    read_adapter,
)
from scheduler_proc.lora.registry import LoraRegistry
from scheduler_proc.model.runner import ModelRunner
from tests.hf_checkpoints import TINY, write_case
from tests.lora_adapters import write_adapter

MAX_RANK = 8


@dataclasses.dataclass(frozen=True)
class Base:
    directory: Path
    config: ModelConfig
    adapter: Path  # rank 4, alpha 8, every projection


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Base:
    root = tmp_path_factory.mktemp("lora_files")
    write_case(root / "base", "llama3")
    config = ModelConfig.from_hf_dict(json.loads((root / "base" / "config.json").read_text()))
    adapter = write_adapter(root / "base", root / "adapter", rank=4, alpha=8, seed=1)
    return Base(root / "base", config, adapter)


def copy_with(base: Base, tmp_path: Path, **config: Any) -> Path:
    """The base adapter in a new directory, its adapter_config.json changed by ``config``."""
    out = tmp_path / "changed"
    shutil.copytree(base.adapter, out)
    raw = json.loads((out / CONFIG_FILE).read_text())
    (out / CONFIG_FILE).write_text(json.dumps(raw | config))
    return out


def test_a_peft_adapter_reads_as_saved(base: Base) -> None:
    weights = read_adapter(base.adapter, base.config, MAX_RANK)
    assert (weights.rank, weights.scaling) == (4, 2.0)
    assert set(weights.pairs) == {(i, p) for i in range(TINY.layers) for p in PROJECTIONS}
    saved = load_file(str(base.adapter / WEIGHTS_FILE))
    pair = weights.pairs[1, "down_proj"]
    prefix = "base_model.model.model.layers.1.mlp.down_proj"
    assert torch.equal(pair.a, saved[f"{prefix}.lora_A.weight"])
    assert torch.equal(pair.b, saved[f"{prefix}.lora_B.weight"])
    assert pair.a.shape == (4, TINY.intermediate) and pair.b.shape == (TINY.hidden, 4)


def test_rslora_scales_by_the_root_of_the_rank(base: Base, tmp_path: Path) -> None:
    path = write_adapter(base.directory, tmp_path, rank=4, alpha=8, use_rslora=True)
    assert read_adapter(path, base.config, MAX_RANK).scaling == 4.0


@pytest.mark.parametrize(
    ("targets", "layers", "expected"),
    [
        (("q_proj",), [1], {(1, "q_proj")}),
        (r".*\.(q|v)_proj", None, {(i, p) for i in range(2) for p in ("q_proj", "v_proj")}),
        ("all-linear", None, {(i, p) for i in range(2) for p in PROJECTIONS}),
    ],
    ids=["layers_to_transform", "regex", "all-linear"],
)
def test_the_tensors_say_what_an_adapter_changes(
    base: Base, tmp_path: Path, targets: Any, layers: list[int] | None, expected: set[Any]
) -> None:
    path = write_adapter(
        base.directory, tmp_path, rank=2, alpha=2, target_modules=targets, layers=layers
    )
    assert set(read_adapter(path, base.config, MAX_RANK).pairs) == expected


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"use_dora": True}, "use_dora=True"),
        ({"bias": "all"}, "bias='all'"),
        ({"lora_bias": True}, "lora_bias=True"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
        ({"alpha_pattern": {"q_proj": 2}}, "alpha_pattern"),
        ({"peft_type": "LOHA"}, "peft_type='LOHA'"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out=True"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules \\['embed_tokens'\\]"),
        ({"layer_replication": [[0, 2]]}, "layer_replication"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'"),
        ({"some_new_switch": True}, "some_new_switch=True"),
        ({"r": 16}, "r=16 exceeds --max-lora-rank 8"),
    ],
)
def test_what_is_not_applied_exactly_is_refused_naming_it(
    base: Base, tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    path = copy_with(base, tmp_path, **change)
    with pytest.raises(LoraError, match=message) as caught:
        read_adapter(path, base.config, MAX_RANK)
    assert str(path) in str(caught.value) and caught.value.status_code == 400


def test_a_newer_peft_key_that_is_off_is_read(base: Base, tmp_path: Path) -> None:
    path = copy_with(base, tmp_path, some_new_switch=None, lora_dropout=0.1)
    assert read_adapter(path, base.config, MAX_RANK).rank == 4


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"use_dora": True}, "use_dora=True"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"target_modules": ["q_proj", "lm_head"]}, "target_modules \\['lm_head'\\]"),
        ({"target_modules": ".*(q_proj|embed_tokens)"}, "tensor .*embed_tokens"),
    ],
    ids=["dora", "modules_to_save", "lm_head", "regex-embeddings"],
)
def test_what_peft_writes_for_unsupported_settings_is_refused(
    base: Base, tmp_path: Path, config: dict[str, Any], message: str
) -> None:
    path = write_adapter(base.directory, tmp_path, rank=2, alpha=2, **config)
    with pytest.raises(LoraError, match=message):
        read_adapter(path, base.config, MAX_RANK)


def test_a_tensor_that_does_not_fit_the_served_model_is_refused(base: Base) -> None:
    narrower = dataclasses.replace(base.config, intermediate_size=96)
    shape = r"layers.0.mlp.down_proj.lora_A.weight' has shape \(4, 128\), expected \(4, 96\)"
    with pytest.raises(LoraError, match=shape):
        read_adapter(base.adapter, narrower, MAX_RANK)
    shallower = dataclasses.replace(base.config, num_hidden_layers=1)
    with pytest.raises(LoraError, match="names layer 1; the served model has 1"):
        read_adapter(base.adapter, shallower, MAX_RANK)


def test_unknown_and_half_pairs_of_tensors_are_refused(base: Base, tmp_path: Path) -> None:
    path = copy_with(base, tmp_path)
    tensors = load_file(str(path / WEIGHTS_FILE))
    extra = tensors | {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, TINY.hidden)}
    save_file(extra, str(path / WEIGHTS_FILE))
    with pytest.raises(LoraError, match="'base_model.model.lm_head.lora_A.weight'"):
        read_adapter(path, base.config, MAX_RANK)
    half = "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"
    save_file({k: v for k, v in tensors.items() if k != half}, str(path / WEIGHTS_FILE))
    with pytest.raises(LoraError, match="layer 0 k_proj has no lora_B"):
        read_adapter(path, base.config, MAX_RANK)


def test_missing_files_and_pickles_are_refused(base: Base, tmp_path: Path) -> None:
    with pytest.raises(LoraError, match=f"{tmp_path / 'nowhere'}: no {CONFIG_FILE}") as caught:
        read_adapter(tmp_path / "nowhere", base.config, MAX_RANK)
    assert caught.value.status_code == 404
    path = copy_with(base, tmp_path)
    (path / WEIGHTS_FILE).rename(path / "adapter_model.bin")
    with pytest.raises(LoraError, match="only adapter_model.bin \\(pickle\\)"):
        read_adapter(path, base.config, MAX_RANK)
    (path / "adapter_model.bin").unlink()
    with pytest.raises(LoraError, match=f"no {WEIGHTS_FILE}"):
        read_adapter(path, base.config, MAX_RANK)


def test_the_registry_gives_ids_and_answers_in_vllms_words(base: Base, tmp_path: Path) -> None:
    registry = LoraRegistry(base.config, MAX_RANK, max_cpu_loras=2)
    first = registry.load("a", str(base.adapter))
    second = registry.load("b", str(base.adapter))
    assert (first.id, second.id) == (1, 2) and registry.adapters() == (first, second)
    with pytest.raises(LoraError, match="^The lora adapter 'a' has already been loaded.") as err:
        registry.load("a", str(base.adapter))
    assert err.value.status_code == 400
    missing = str(tmp_path / "missing")
    with pytest.raises(LoraError) as err:
        registry.load("c", missing)
    assert str(err.value) == f"Loading lora c failed: No adapter found for {missing}"
    assert err.value.status_code == 404
    bad = copy_with(base, tmp_path, use_dora=True)
    with pytest.raises(LoraError, match="^Loading lora c failed: .*use_dora=True") as err:
        registry.load("c", str(bad))
    assert err.value.status_code == 400 and registry.adapters() == (first, second)
    assert registry.unload("a") == first
    with pytest.raises(LoraError) as err:
        registry.unload("a")
    assert (str(err.value), err.value.status_code) == ("The lora adapter 'a' cannot be found.", 404)
    assert registry.by_id(first.id) is None and registry.by_id(second.id) == second
    again = registry.load("a", str(base.adapter))
    assert again.id == 3 and registry.adapters() == (second, again)
    # Requests still running on the unloaded adapter read its weights.
    assert registry.weights(first).rank == 4


def test_host_copies_keep_the_most_recent_and_read_the_rest_again(
    base: Base, tmp_path: Path
) -> None:
    registry = LoraRegistry(base.config, MAX_RANK, max_cpu_loras=1)
    moved = tmp_path / "a"
    shutil.copytree(base.adapter, moved)
    a = registry.load("a", str(moved))
    b = registry.load("b", str(base.adapter))
    assert registry.host_copies() == (b.id,)
    assert registry.weights(b) is registry.weights(b)
    # a was evicted: it is read from its directory again, as the directory now holds it.
    write_adapter(base.directory, moved, rank=2, alpha=2, seed=5)
    assert registry.weights(a).rank == 2 and registry.host_copies() == (a.id,)


def test_an_unreadable_start_adapter_fails_the_start(base: Base, tmp_path: Path) -> None:
    bad = copy_with(base, tmp_path, bias="all")
    config = ServerConfig(
        model_path=str(base.directory),
        device="cpu",
        max_total_tokens=64,
        lora_modules=(f"good={base.adapter}", f"bad={bad}"),
        max_lora_rank=MAX_RANK,
    )
    with pytest.raises(LoraError, match="^Loading lora bad failed: .*bias='all'"):
        ModelRunner(config, SHIPPED_VOCAB_SIZE)
