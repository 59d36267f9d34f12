"""Writes small checkpoints of each model family tokenpipe serves, **with transformers
itself** (its config classes, ``from_config`` and ``save_pretrained``), seeded random weights
and the shipped tokenizer: what the family tests compare against and what
``bench/families.py`` serves.

Families (``FAMILIES``): ``llama`` (plain), ``llama3`` (``rope_scaling`` llama3, tied
embeddings), ``qwen2`` (q/k/v biases, tied embeddings), ``qwen3`` (per-head q/k RMSNorm and
its own head_dim) and ``mistral`` (a sliding window no shorter than the positions).
transformers initialises with std 0.02, which makes attention near-uniform and greedy text
stick on one token; the weights are redrawn (``_init``) so context (and so the rotary) changes
the logits and the next-token distribution is far from flat. Usage: bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from pipeline.tokenizer_loader import (
    DEFAULT_TOKENIZER_DIR,
    SHIPPED_EOS_TOKEN_IDS,
    SHIPPED_VOCAB_SIZE,
)  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """The default model's shape unless asked: a family's run sits beside the built-in
    Llama of the same size."""

    hidden: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 704
    positions: int = 2048

    def kwargs(self) -> dict[str, Any]:
        return {
            "vocab_size": SHIPPED_VOCAB_SIZE,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "max_position_embeddings": self.positions,
        }


# original_max_position_embeddings well inside the context, so the scaling changes
# frequencies that short prompts use.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# family -> (transformers config class name, its config keys beyond the shape)
FAMILIES: dict[str, tuple[str, Callable[[Shape], dict[str, Any]]]] = {
    "llama": ("LlamaConfig", lambda s: {}),
    "llama3": ("LlamaConfig", lambda s: {"rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", lambda s: {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", lambda s: {"head_dim": s.hidden // s.heads}),  # Qwen3's default is 128
    "mistral": ("MistralConfig", lambda s: {"sliding_window": s.positions}),
}


def hf_config(family: str, shape: Shape = Shape(), **overrides: Any) -> Any:
    """transformers' config of ``family``; ``overrides``: config keys that vary it (another
    rope_scaling, head_dim, attention_bias...)."""
    import transformers

    class_name, extra = FAMILIES[family]
    return getattr(transformers, class_name)(**shape.kwargs(), **{**extra(shape), **overrides})


def write(
    directory: Path,
    family: str,
    *,
    shape: Shape = Shape(),
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Any:
    """Writes the checkpoint and returns transformers' model (in ``dtype``, eval mode)."""
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config(family, shape, **overrides), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # a tied lm_head is the embeddings, listed once
            p.normal_(*_init(name))
    model = model.to(dtype)
    model.save_pretrained(
        directory, **({"max_shard_size": max_shard_size} if max_shard_size else {})
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DEFAULT_TOKENIZER_DIR / name, directory / name)
    # The built-in model's EOS, so the checkpoint stops where it would.
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": sorted(SHIPPED_EOS_TOKEN_IDS)})
    )
    return model


def _init(name: str) -> tuple[float, float]:
    """(mean, std) of a parameter. Embeddings large enough that the current token shows
    through; q and k sharp enough that attention is not uniform; the projections that write
    into the residual stream (v, o, the MLP) wide enough that the context, not the current
    token's embedding, decides what comes next (with a tied head at 0.02 every family echoed
    its last input token); an untied head like the embeddings, or every greedy pick is a
    near tie."""
    if "norm" in name:
        return 1.0, 0.1
    if "embed_tokens" in name or name == "lm_head.weight":
        return 0.0, 0.5
    if name.endswith("bias") or "q_proj" in name or "k_proj" in name:
        return 0.0, 0.1
    return 0.0, 0.15


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory", type=Path)
    p.add_argument("family", choices=sorted(FAMILIES))
    p.add_argument("--hidden", type=int, default=Shape.hidden)
    p.add_argument("--layers", type=int, default=Shape.layers)
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    p.add_argument("--max-shard-size", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    shape = Shape(
        hidden=args.hidden,
        layers=args.layers,
        heads=max(1, args.hidden // 32),
        kv_heads=max(1, args.hidden // 64),
    )
    write(
        args.directory,
        args.family,
        shape=shape,
        seed=args.seed,
        dtype=_DTYPES[args.dtype],
        max_shard_size=args.max_shard_size,
    )
    print(f"wrote {args.directory}: {args.family} {shape}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
