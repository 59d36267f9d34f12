"""Tiny checkpoints of each served family for the end-to-end family tests, written by
transformers itself through ``bench/family_checkpoints.py`` (its config classes,
``from_config``, ``save_pretrained``; seeded; the weights redrawn so greedy text depends on
the context; the shipped tokenizer and its EOS ids), and the transformers model that wrote
each, the reference the server is compared with.

``CASES`` names what each family's checkpoint proves beyond the family itself:

- ``llama3``: ``rope_scaling`` llama3 with ``original_max_position_embeddings`` 64 (short
  prompts already see scaled frequencies), tied embeddings, ``attention_bias`` and an
  explicit ``head_dim`` (32, where hidden/heads is 16);
- ``qwen2``: q/k/v biases, tied embeddings;
- ``qwen3``: per-head q/k RMSNorm and an explicit ``head_dim`` of 32; written sharded, so
  every family test also proves ``model.safetensors.index.json`` is followed;
- ``mistral``: a ``sliding_window`` of 128, half of ``max_position_embeddings``. transformers
  masks a key only once it is a window or more behind the query, so within 128 tokens the
  window changes nothing and the served context is capped at it (a longer one is refused).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import family_checkpoints
from bench.family_checkpoints import Shape
from pipeline.tokenizer_loader import DEFAULT_TOKENIZER_DIR

TINY = Shape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, positions=256)
MISTRAL_WINDOW = 128
SHARD_SIZE = "100KB"  # the tiny model's float32 weights are about 2.5 MB: many shards

# family -> (a family of bench/family_checkpoints.py, config keys that vary it, shard size)
CASES: dict[str, tuple[str, dict[str, Any], str | None]] = {
    "llama3": ("llama3", {"head_dim": 32, "attention_bias": True}, None),
    "qwen2": ("qwen2", {}, None),
    "qwen3": ("qwen3", {"head_dim": 32}, SHARD_SIZE),
    "mistral": ("mistral", {"sliding_window": MISTRAL_WINDOW}, None),
}


def require_transformers() -> None:
    """Skips without transformers, except under CI=true, where a missing reference fails."""
    if importlib.util.find_spec("transformers") is None:
        message = "transformers is not installed (make test installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(message + "; CI=true: a missing reference is a failure")
        pytest.skip(message)


def write_case(
    directory: Path,
    case: str,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    sharded: bool | None = None,
) -> Any:
    """Writes ``case``'s checkpoint (sharded as ``CASES`` says unless ``sharded`` is given)
    and returns transformers' model of it in ``dtype``, eval mode."""
    require_transformers()
    family, overrides, shard_size = CASES[case]
    if sharded is not None:
        shard_size = SHARD_SIZE if sharded else None
    return family_checkpoints.write(
        directory,
        family,
        shape=TINY,
        seed=seed,
        dtype=dtype,
        max_shard_size=shard_size,
        **overrides,
    )


def context_length(case: str) -> int:
    """The context a server of ``case`` serves: the positions, or Mistral's window."""
    return MISTRAL_WINDOW if case == "mistral" else TINY.positions


def write_unsupported(directory: Path, architecture: str = "GPT2LMHeadModel") -> None:
    """A checkpoint directory whose config.json names ``architecture`` (and GPT-2's
    model_type), with the shipped tokenizer: the server must refuse it at start."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DEFAULT_TOKENIZER_DIR / name, directory / name)
    config = {
        "architectures": [architecture],
        "model_type": "gpt2",
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "vocab_size": 1000,
    }
    (directory / "config.json").write_text(json.dumps(config))
