"""Reads a LoRA adapter directory as ``peft`` writes it (``adapter_config.json`` and
``adapter_model.safetensors``) into float32 host tensors, and refuses, naming the key, every
setting the server would not apply exactly as PEFT's ``LoraModel`` does in eval mode:
``y = W x + B (A x) * scaling``. Which layers and projections an adapter changes is what its
tensors name (``target_modules`` and ``layers_to_transform`` only decided what peft saved).
Pickled weights (``adapter_model.bin``) are never read: a file is data, never code."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError, safe_open

from pipeline.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS_FILE = "adapter_model.bin"

# The projections an adapter may change, each with the module of the decoder layer it is in.
PROJECTIONS: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}

_TENSOR_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight"
)

# Keys that change what the adapter computes, and the one value at which they change nothing.
_MUST_BE: dict[str, Any] = {
    "peft_type": "LORA",
    "bias": "none",
    "use_dora": False,
    "lora_bias": False,
    "fan_in_fan_out": False,
    "use_qalora": False,
}
# Keys that change what the adapter computes whenever they are set (not null, empty or false).
_MUST_BE_UNSET = (
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
    "layer_replication",
    "trainable_token_indices",
    "target_parameters",
    "alora_invocation_tokens",
    "megatron_config",
    "kasa_config",
    "monteclora_config",
    "arrow_config",
    "use_bdlora",
)
# Keys of training, initialisation or bookkeeping: an eval forward never reads them.
_NEUTRAL = frozenset(
    {
        "r",
        "lora_alpha",
        "use_rslora",
        "target_modules",
        "init_lora_weights",
        "base_model_name_or_path",
        "revision",
        "task_type",
        "inference_mode",
        "auto_mapping",
        "peft_version",
        "lora_dropout",
        "layers_to_transform",
        "layers_pattern",
        "exclude_modules",
        "ensure_weight_tying",
        "qalora_group_size",
        "megatron_core",
        "loftq_config",
        "eva_config",
        "corda_config",
        "lora_ga_config",
    }
)
# Initialisations whose saved A and B are the whole change (PiSSA, OLoRA, CorDA, LoRA-GA and
# LoftQ also rewrite the base weights; peft saves them converted, as init_lora_weights true).
_PLAIN_INITS = ("gaussian", "eva", "orthogonal")  # and true or false


class LoraError(ValueError):
    """An adapter that cannot be served, or a name that cannot be (un)loaded, with the HTTP
    status the answer deserves: 404 for what is not there, 400 otherwise."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.status_code = status_code


class LoraPair(NamedTuple):
    a: torch.Tensor  # [rank, in] float32
    b: torch.Tensor  # [out, rank] float32


@dataclass(frozen=True)
class LoraWeights:
    """One adapter as read: the pairs of the (layer, projection)s it changes."""

    rank: int
    scaling: float
    pairs: dict[tuple[int, str], LoraPair]


def projection_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of ``PROJECTIONS`` in ``cfg``'s decoder."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def read_adapter(path: str | Path, model_config: ModelConfig, max_rank: int) -> LoraWeights:
    """The adapter in directory ``path``, checked against the served model; LoraError naming
    the key (and the path) of whatever would not be applied exactly."""
    directory = Path(path)
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_file.is_file():
        raise LoraError(f"{directory}: no {CONFIG_FILE} (not a peft adapter directory)", 404)
    if not weights_file.is_file():
        if (directory / PICKLED_WEIGHTS_FILE).exists():
            raise LoraError(
                f"{directory}: only {PICKLED_WEIGHTS_FILE} (pickle) is present; tokenpipe reads "
                f"{WEIGHTS_FILE} only (save the adapter with safe_serialization=True)"
            )
        raise LoraError(f"{directory}: no {WEIGHTS_FILE}", 404)
    rank, scaling = _check_config(_read_json(config_file), config_file, max_rank)
    pairs = _read_pairs(weights_file, model_config, rank)
    return LoraWeights(rank, scaling, pairs)


def _read_json(config_file: Path) -> dict[str, Any]:
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraError(f"{config_file} cannot be read as JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise LoraError(f"{config_file} must hold a JSON object")
    return raw


def _check_config(raw: dict[str, Any], where: Path, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a peft LoraConfig dict whose every setting is applied exactly."""
    for key, value in raw.items():
        if key in _MUST_BE:
            if value != _MUST_BE[key]:
                raise LoraError(
                    f"{where}: {key}={value!r} is not supported (only {_MUST_BE[key]!r})"
                )
        elif key in _MUST_BE_UNSET or key not in _NEUTRAL:
            # Unknown keys of a newer peft pass only while they are off.
            if value not in (None, False, "", [], {}):
                raise LoraError(f"{where}: {key}={value!r} is not supported")
    if raw.get("peft_type") is None:
        raise LoraError(f"{where}: peft_type is missing (expected 'LORA')")
    init = raw.get("init_lora_weights", True)
    if not (isinstance(init, bool) or init in _PLAIN_INITS):
        raise LoraError(
            f"{where}: init_lora_weights={init!r} rewrites the base weights; save the adapter "
            "converted (path_initial_model_for_weight_conversion)"
        )
    _check_targets(raw.get("target_modules"), where)
    rank, alpha = raw.get("r", 8), raw.get("lora_alpha", 8)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise LoraError(f"{where}: r={rank!r} must be a positive integer")
    if rank > max_rank:
        raise LoraError(f"{where}: r={rank} exceeds --max-lora-rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoraError(f"{where}: lora_alpha={alpha!r} must be a number")
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    return rank, scaling


def _check_targets(targets: Any, where: Path) -> None:
    """A list names modules by their last dotted parts (peft's suffix match); a string is a
    regular expression peft matched to full names, and the tensors say what it chose."""
    if targets is None or isinstance(targets, str):
        return
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise LoraError(f"{where}: target_modules={targets!r} must be a list of names or a string")
    outside = [t for t in targets if t.rsplit(".", 1)[-1] not in PROJECTIONS]
    if outside:
        raise LoraError(
            f"{where}: target_modules {outside} are not supported; "
            f"an adapter may change {', '.join(PROJECTIONS)}"
        )


def _read_pairs(weights_file: Path, cfg: ModelConfig, rank: int) -> dict[tuple[int, str], LoraPair]:
    shapes = projection_shapes(cfg)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_file), framework="pt", device="cpu") as f:
            for name in f.keys():
                layer, proj, half = _place(name, weights_file, cfg)
                n_in, n_out = shapes[proj]
                expected = (rank, n_in) if half == "A" else (n_out, rank)
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != expected:
                    raise LoraError(
                        f"{weights_file}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {expected} (r={rank} and the served model's config)"
                    )
                halves.setdefault((layer, proj), {})[half] = tensor.float()
    except SafetensorError as exc:
        raise LoraError(f"{weights_file} cannot be read as safetensors: {exc}") from exc
    pairs = {}
    for (layer, proj), both in sorted(halves.items()):
        if len(both) != 2:
            missing = "B" if "A" in both else "A"
            raise LoraError(f"{weights_file}: layer {layer} {proj} has no lora_{missing} tensor")
        pairs[layer, proj] = LoraPair(both["A"], both["B"])
    if not pairs:
        raise LoraError(f"{weights_file} holds no LoRA tensors")
    return pairs


def _place(name: str, weights_file: Path, cfg: ModelConfig) -> tuple[int, str, str]:
    """(layer, projection, "A" or "B") of a tensor name peft writes; LoraError naming any
    other tensor (an embedding's, the head's, a DoRA magnitude, a bias)."""
    match = _TENSOR_NAME.fullmatch(name)
    if match is None or PROJECTIONS.get(match[3]) != match[2]:
        raise LoraError(
            f"{weights_file}: tensor {name!r} is not supported; "
            f"an adapter may change {', '.join(PROJECTIONS)} of the decoder layers"
        )
    layer = int(match[1])
    if layer >= cfg.num_hidden_layers:
        raise LoraError(
            f"{weights_file}: tensor {name!r} names layer {layer}; the served model has "
            f"{cfg.num_hidden_layers}"
        )
    return layer, match[3], match[4]
