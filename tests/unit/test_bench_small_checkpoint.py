"""bench/small_checkpoint.py writes a model directory the server loads: the shape asked,
the shipped tokenizer, its EOS."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.small_checkpoint import main
from pipeline.tokenizer_loader import SHIPPED_EOS_TOKEN_IDS, SHIPPED_VOCAB_SIZE, load_tokenizer
from scheduler_proc.model.llama import LlamaForCausalLM


def test_the_checkpoint_loads_with_the_shape_asked(tmp_path: Path) -> None:
    assert main([str(tmp_path), "--layers", "3", "--hidden", "64"]) == 0
    model = LlamaForCausalLM.from_pretrained(str(tmp_path), device="cpu")
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (
        3,
        64,
        SHIPPED_VOCAB_SIZE,
    )
    tok = load_tokenizer(str(tmp_path))
    assert tok.vocab_size == SHIPPED_VOCAB_SIZE and tok.eos_token_ids == SHIPPED_EOS_TOKEN_IDS
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == sorted(
        SHIPPED_EOS_TOKEN_IDS
    )
    assert all(torch.isfinite(p).all() for p in model.parameters())
