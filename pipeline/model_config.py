"""Shape of the Llama-style model, read from and written to a HF ``config.json`` dict, and
the context limit that follows from it. Torch-free, so the API process validates prompts
against the same numbers the scheduler uses."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.config import ServerConfig


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for key in _INT_FIELDS:
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{key} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Read a HF LlamaConfig dict; reject settings this model does not implement
        rather than silently computing something different from the checkpoint."""
        ints = {key: _positive_int(d, key) for key in _INT_FIELDS if key != "num_key_value_heads"}
        # HF treats a missing num_key_value_heads as plain multi-head attention.
        if d.get("num_key_value_heads") is None:
            ints["num_key_value_heads"] = ints["num_attention_heads"]
        else:
            ints["num_key_value_heads"] = _positive_int(d, "num_key_value_heads")

        head_dim = d.get("head_dim")
        if head_dim is not None and head_dim != ints["hidden_size"] // ints["num_attention_heads"]:
            raise ValueError(
                f"config key 'head_dim'={head_dim!r} is not supported: expected "
                "hidden_size // num_attention_heads"
            )
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config key 'hidden_act'={act!r} is not supported: expected 'silu'")
        if d.get("rope_scaling") is not None:
            raise ValueError(
                f"config key 'rope_scaling'={d['rope_scaling']!r} is not supported: expected null"
            )
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key):
                raise ValueError(f"config key {key!r}=true is not supported: this model has no biases")

        tie = d.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise ValueError(f"config key 'tie_word_embeddings' must be a bool, got {tie!r}")
        return cls(
            **ints,
            rms_norm_eps=_positive_float(d, "rms_norm_eps", 1e-5),
            rope_theta=_positive_float(d, "rope_theta", 10000.0),
            tie_word_embeddings=tie,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "head_dim": self.head_dim,
            **asdict(self),
        }


_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
)


def default_model_config(vocab_size: int) -> ModelConfig:
    """Small enough that the CPU test suite runs a real model in seconds, with GQA so
    the grouped-head path is exercised."""
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    )


def load_model_config(config: ServerConfig, vocab_size: int) -> ModelConfig:
    """The model directory's ``config.json``, or the built-in model's shape without one."""
    if config.model_path is None:
        return default_model_config(vocab_size)
    path = Path(config.model_path) / "config.json"
    try:
        return ModelConfig.from_hf_dict(json.loads(path.read_text()))
    except FileNotFoundError as exc:
        raise ValueError(f"model directory has no config.json: {path}") from exc


def context_length_of(config: ServerConfig, vocab_size: int) -> int:
    """The longest sequence (prompt plus output) a request may reach."""
    model_max = load_model_config(config, vocab_size).max_position_embeddings
    return min(config.context_length or model_max, model_max)


def _positive_int(d: dict[str, Any], key: str) -> int:
    if key not in d:
        raise ValueError(f"config is missing required key {key!r}")
    value = d[key]
    # bool is an int subclass; `true` as a layer count is a broken config, not 1.
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config key {key!r} must be a positive integer, got {value!r}")
    return value


def _positive_float(d: dict[str, Any], key: str, default: float) -> float:
    value = d.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config key {key!r} must be a positive number, got {value!r}")
    return float(value)
