"""The model's shape and context limit, read without torch, so the API process can
validate prompts against the same numbers the scheduler uses."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.config import ServerConfig
from scheduler_proc.model_config import ModelConfig, default_model_config


def load_model_config(config: ServerConfig, vocab_size: int) -> ModelConfig:
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
