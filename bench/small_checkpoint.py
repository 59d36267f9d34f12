"""Writes a small Llama-style checkpoint with seeded random weights and the shipped
tokenizer, for benchmarks that want a model lighter than the built-in one (so the
output path, not the forward, sets the pace), e.g. ``bench/serve.py --launch
--server-args "--model-path DIR"``.

Usage: ``python bench/small_checkpoint.py DIR [--layers 2] [--hidden 128] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tokenizers  # noqa: E402

from pipeline.model_config import ModelConfig  # noqa: E402
from pipeline.tokenizer_loader import (
    DEFAULT_TOKENIZER_DIR,
    SHIPPED_EOS_TOKEN_IDS,
    SHIPPED_VOCAB_SIZE,
)  # noqa: E402
from scheduler_proc.model.llama import LlamaForCausalLM  # noqa: E402


def write(
    directory: Path,
    *,
    layers: int,
    hidden: int,
    seed: int,
    added_tokens: Sequence[str] = (),
    special_tokens: Sequence[str] = (),
    max_position_embeddings: int = 2048,
) -> ModelConfig:
    """``added_tokens``: texts the tokenizer takes as single tokens after the shipped
    vocabulary (as Qwen3's ``<think>``: added, not special), then ``special_tokens`` (as
    Mistral's ``[TOOL_CALLS]``: special, so ``skip_special_tokens`` drops them), and the
    model's vocabulary with them."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DEFAULT_TOKENIZER_DIR / name, directory / name)
    if added_tokens or special_tokens:
        tokenizer = tokenizers.Tokenizer.from_file(str(DEFAULT_TOKENIZER_DIR / "tokenizer.json"))
        tokenizer.add_tokens(
            [tokenizers.AddedToken(text, special=False, normalized=False) for text in added_tokens]
        )
        tokenizer.add_special_tokens(
            [tokenizers.AddedToken(text, special=True, normalized=False) for text in special_tokens]
        )
        tokenizer.save(str(directory / "tokenizer.json"))
    shape = ModelConfig(
        vocab_size=SHIPPED_VOCAB_SIZE + len(added_tokens) + len(special_tokens),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 32),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=max_position_embeddings,
    )
    LlamaForCausalLM.random(shape, seed=seed, device="cpu").save_pretrained(directory)
    # The built-in model's EOS, so the checkpoint stops where it would.
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": sorted(SHIPPED_EOS_TOKEN_IDS)})
    )
    return shape


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory", type=Path)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    shape = write(args.directory, layers=args.layers, hidden=args.hidden, seed=args.seed)
    print(f"wrote {args.directory}: {shape}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
