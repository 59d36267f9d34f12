"""Writes a *copy* checkpoint for the speculative benchmark (bench/serve_speculative.py): a
transformers ``LlamaForCausalLM`` of bench/small_checkpoint.py's shape and tokenizer whose
greedy answer repeats its prompt. A random model does not copy, so: a permutation sigma of the
vocabulary made of short seeded cycles (``cycle_successors``; the low ids, the special tokens,
map to themselves), the head the embedding rows permuted by it (row sigma(x) is x's embedding:
the final hidden state of token x scores sigma(x) highest), and each layer's o_proj and
down_proj scaled down: the layers still compute and move the logits, but the next token is
mostly sigma(current). A sigma-chain prompt (bench/serve_client.py's ``chain_prompt``) holds
the cycle its answer goes round, as a code edit repeats its input. sigma is written beside the
weights (``PERMUTATION_FILE``). Usage: ``python bench/copy_checkpoint.py DIR [--seed 0]``; it
prints the check: how often greedy answers follow sigma and repeat their prompt's pairs.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.serve_client import FIRST_ID, chain_prompt  # noqa: E402
from bench.small_checkpoint import write as write_small  # noqa: E402
from pipeline.tokenizer_loader import SHIPPED_VOCAB_SIZE  # noqa: E402

PERMUTATION_FILE = "copy_permutation.json"  # {"seed", "successors": sigma as a list}
CYCLE_MIN, CYCLE_MAX = 8, 24
RESIDUAL_SCALE = 0.05  # o_proj and down_proj, against small_checkpoint's init


def cycle_successors(vocab: int, seed: int) -> list[int]:
    """sigma as successors (``s[x]`` follows ``x``): the ids from ``FIRST_ID`` shuffled and
    cut into cycles of ``CYCLE_MIN``..``CYCLE_MAX`` ids; the ids below map to themselves."""
    rng = random.Random(seed)
    ids = list(range(FIRST_ID, vocab))
    rng.shuffle(ids)
    successors = list(range(vocab))
    start = 0
    while start < len(ids):
        rest = len(ids) - start
        # Never leave a tail shorter than CYCLE_MIN: the last cycle takes what is left.
        n = rest if rest <= CYCLE_MAX else rng.randint(CYCLE_MIN, min(CYCLE_MAX, rest - CYCLE_MIN))
        cycle = ids[start : start + n]
        for a, b in zip(cycle, cycle[1:] + cycle[:1]):
            successors[a] = b
        start += n
    return successors


def read_successors(directory: Path) -> list[int]:
    """sigma of a copy checkpoint (ValueError: the directory holds none)."""
    path = directory / PERMUTATION_FILE
    if not path.is_file():
        raise ValueError(f"{directory} is not a copy checkpoint (no {PERMUTATION_FILE})")
    successors: list[int] = json.loads(path.read_text())["successors"]
    return successors


def write(
    directory: Path,
    *,
    layers: int = 2,
    hidden: int = 128,
    seed: int = 0,
    residual_scale: float = RESIDUAL_SCALE,
) -> Any:
    """Writes the checkpoint (small_checkpoint's shape, init and tokenizer files, then the
    copy weights, saved by transformers) and sigma; returns transformers' model."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    write_small(directory, layers=layers, hidden=hidden, seed=seed)
    model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    successors = cycle_successors(model.config.vocab_size, seed)
    predecessors = torch.empty(len(successors), dtype=torch.long)
    predecessors[torch.tensor(successors)] = torch.arange(len(successors))
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        model.lm_head.weight.copy_(embed[predecessors])  # row sigma(x) = embedding of x
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(residual_scale)
            layer.mlp.down_proj.weight.mul_(residual_scale)
    for stale in directory.glob("*.safetensors*"):
        stale.unlink()
    model.save_pretrained(directory)
    (directory / PERMUTATION_FILE).write_text(json.dumps({"seed": seed, "successors": successors}))
    return model


@dataclass(frozen=True)
class CopyCheck:
    """Greedy answers to chain prompts: the share of answer tokens that are sigma of the
    token before them, and the share whose pair (token before, token) is in the prompt."""

    tokens: int
    follow_sigma: float
    repeat_prompt: float


def check(model: Any, successors: Sequence[int], prompts: int, length: int, new: int) -> CopyCheck:
    """transformers' greedy ``generate`` on ``prompts`` chain prompts of ``length`` ids."""
    rng = random.Random("copy-check")
    follow = repeat = total = 0
    for _ in range(prompts):
        ids = chain_prompt(successors, rng, length)
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False
        )[0].tolist()
        pairs = set(zip(ids, ids[1:]))
        for prev, tok in zip(out[length - 1 : -1], out[length:]):
            follow += tok == successors[prev]
            repeat += (prev, tok) in pairs
            total += 1
    return CopyCheck(total, follow / total, repeat / total)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory", type=Path)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--residual-scale", type=float, default=RESIDUAL_SCALE)
    p.add_argument("--check-prompts", type=int, default=16, help="0: no check")
    args = p.parse_args(argv)
    model = write(
        args.directory,
        layers=args.layers,
        hidden=args.hidden,
        seed=args.seed,
        residual_scale=args.residual_scale,
    )
    print(f"wrote {args.directory} (vocabulary {SHIPPED_VOCAB_SIZE}, sigma in {PERMUTATION_FILE})")
    if args.check_prompts:
        c = check(model, read_successors(args.directory), args.check_prompts, 32, 128)
        print(
            f"greedy, {args.check_prompts} chain prompts of 32 ids, 128 new tokens each "
            f"(transformers): {c.follow_sigma:.1%} of the {c.tokens} answer tokens follow sigma, "
            f"{c.repeat_prompt:.1%} repeat a pair of their prompt"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
