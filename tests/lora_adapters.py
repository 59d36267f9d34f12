"""LoRA adapters written by ``peft`` itself for the tests, and peft's model of them, the
reference the server's adapter rows are compared with.

``write_adapter`` loads the transformers model of a checkpoint directory (one of
``tests/hf_checkpoints.py``), wraps it with ``LoraConfig(init_lora_weights=False)`` (random A
and B, so the adapter changes the output; seeded) and saves it with ``save_pretrained``, as
a user's adapter is saved. ``peft_reference`` loads it back as peft does for inference."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def require_peft() -> None:
    """Skips without peft and transformers, except under CI=true, where it fails."""
    for package in ("peft", "transformers"):
        if importlib.util.find_spec(package) is None:
            message = f"{package} is not installed (make test installs it)"
            if os.environ.get("CI") == "true":
                pytest.fail(message + "; CI=true: a missing reference is a failure")
            pytest.skip(message)


def write_adapter(
    base_dir: str | Path,
    out_dir: str | Path,
    *,
    rank: int,
    alpha: int,
    target_modules: tuple[str, ...] | str = DEFAULT_TARGETS,
    seed: int = 0,
    use_rslora: bool = False,
    layers: list[int] | None = None,
    **config: Any,
) -> Path:
    """Writes a peft adapter of the checkpoint in ``base_dir`` into ``out_dir`` and returns
    ``out_dir``. ``layers``: peft's ``layers_to_transform``; ``config``: more LoraConfig
    fields, written as given."""
    require_peft()
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora_config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        init_lora_weights=False,
        use_rslora=use_rslora,
        layers_to_transform=layers,
        **config,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = peft.get_peft_model(base, lora_config)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    return out


def peft_reference(base_dir: str | Path, adapter_dir: str | Path) -> Any:
    """peft's float32 model of the base checkpoint with the adapter, in eval mode."""
    require_peft()
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, adapter_dir).eval()
