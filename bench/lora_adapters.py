"""Writes LoRA adapters in PEFT's format for the benchmarks, without peft: an
``adapter_config.json`` (``peft_type`` LORA, ``r``, ``lora_alpha``, ``target_modules``) and an
``adapter_model.safetensors`` holding, for every decoder layer and each of the seven
projections, ``base_model.model.model.layers.{i}.{self_attn,mlp}.{proj}.lora_A.weight``
``[r, in]`` and ``lora_B.weight`` ``[out, r]``, float32 with seeded random values. The shapes
come from the served model's config: the built-in model's without ``--model-path``
(docs/design/lora.md says what the server reads and refuses).

Usage: ``python bench/lora_adapters.py DIR [--count 4] [--rank 16] [--model-path M]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from pipeline.config import ServerConfig  # noqa: E402
from pipeline.model_config import ModelConfig, load_model_config  # noqa: E402
from pipeline.tokenizer_loader import load_tokenizer  # noqa: E402
from scheduler_proc.lora.adapter_files import (  # noqa: E402
    CONFIG_FILE,
    PROJECTIONS,
    WEIGHTS_FILE,
    projection_shapes,
)

NAME_PREFIX = "bench-lora-"  # adapter i is served as bench-lora-i


def served_model_config(model_path: str | None) -> ModelConfig:
    """The shape of the model a server with this ``--model-path`` serves (None: built-in)."""
    config = ServerConfig(model_path=model_path)
    return load_model_config(config, load_tokenizer(config.model_path).vocab_size)


def adapter_tensors(cfg: ModelConfig, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Every projection of every layer: A ``[rank, in]`` and B ``[out, rank]``, scaled so that
    the delta stays of the order of the projection's output (the values are not the point,
    but a finite, changed output is)."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(cfg.num_hidden_layers):
        for proj, (n_in, n_out) in projection_shapes(cfg).items():
            stem = f"base_model.model.model.layers.{layer}.{PROJECTIONS[proj]}.{proj}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) / n_in**0.5
            tensors[f"{stem}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) / rank
    return tensors


def write_adapter(
    directory: Path, cfg: ModelConfig, *, rank: int, alpha: int, seed: int, base: str
) -> Path:
    """One adapter of ``cfg``'s shape in ``directory``; returns ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(PROJECTIONS),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    tensors = adapter_tensors(cfg, rank, seed)
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    return directory


def write_adapters(
    root: Path, count: int, rank: int, model_path: str | None, seed: int = 0
) -> dict[str, Path]:
    """``count`` adapters of rank ``rank`` (``lora_alpha`` twice it) under ``root``, each
    with its own seed; their served names (``NAME_PREFIX`` + i) to their directories."""
    cfg = served_model_config(model_path)
    base = model_path or "tokenpipe built-in model"
    return {
        f"{NAME_PREFIX}{i}": write_adapter(
            root / f"{NAME_PREFIX}{i}", cfg, rank=rank, alpha=2 * rank, seed=seed + i, base=base
        )
        for i in range(count)
    }


def server_flags(adapters: dict[str, Path], rank: int) -> list[str]:
    """The ``tokenpipe serve`` flags that serve ``adapters`` at once (a slot each)."""
    return [
        "--enable-lora",
        "--lora-modules",
        *(f"{name}={path}" for name, path in adapters.items()),
        "--max-loras",
        str(max(1, len(adapters))),
        "--max-lora-rank",
        str(rank),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory", type=Path)
    p.add_argument("--count", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--model-path", default=None, help="the served checkpoint (default built-in)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    adapters = write_adapters(args.directory, args.count, args.rank, args.model_path, args.seed)
    print("tokenpipe serve flags: " + " ".join(server_flags(adapters, args.rank)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
