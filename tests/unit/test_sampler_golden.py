"""The sampler's draws, pinned token for token: a broad set of cases generated from a fixed
seed (every cut, temperatures from tiny to 1.5, ties, -inf masks, bans, grammar masks,
penalties, float32 and bfloat16, batch 1 to 256, the sorted fallback) against the tokens
recorded in tests/unit/data/sampler_golden.json. A faster sampler must draw the same bits.

Re-record (``python tests/unit/test_sampler_golden.py``) only when the draws are meant to
change. A rounding moves a token only when it lands on a boundary, which random draws almost
never show, so the sums the draws hang on are also held bit for bit: the running sums to
numpy's order, and each row's sums to its value alone.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

if __package__ in (None, ""):  # run as a script to re-record: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import scheduler_proc.sampling.sampler as sampler_module
from pipeline.io_struct import SamplingParams
from scheduler_proc.sampling.grammar import GrammarMask
from scheduler_proc.sampling.sampler import BannedTokens, SamplingColumns, draw_counter, sample

DATA = Path(__file__).parent / "data" / "sampler_golden.json"


@dataclass(frozen=True)
class Case:
    """One batch shape and mix; each case is drawn ``draws`` times with fresh seeds and
    counters. ``rows``: the logits kinds (``_row``) and ``params`` the parameter mix
    (``_params``) its rows pick from; ``max_rounds`` the rejection's round limit."""

    name: str
    batch: int
    vocab: int
    rows: tuple[str, ...]
    params: str
    draws: int = 3
    dtype: torch.dtype = torch.float32
    max_rounds: int = 32
    extras: tuple[str, ...] = ()  # "penalties", "banned", "grammar"


_ALL_ROWS = ("flat", "peaked", "tied", "tied_top", "masked", "one_left", "ramp", "huge")
# A grammar's mask on top of a row's own -inf could leave nothing (the engine never lets it).
_FINITE_ROWS = ("flat", "peaked", "tied", "tied_top", "ramp", "huge")

CASES = (
    Case("bench_256", 256, 4096, ("flat",), "bench"),
    Case("mixed_256_f32", 256, 4096, _ALL_ROWS, "mixed"),
    Case("mixed_256_bf16", 256, 4096, _ALL_ROWS, "mixed", dtype=torch.bfloat16),
    Case("mixed_256_padded", 256, 1000, _ALL_ROWS, "mixed"),
    Case("mixed_64_extras", 64, 1000, _ALL_ROWS, "mixed", 4, extras=("penalties", "banned")),
    Case("mixed_64_grammar", 64, 1000, _FINITE_ROWS, "mixed", 4, extras=("grammar", "banned")),
    Case("batch_1", 1, 4096, _ALL_ROWS, "mixed", 96),
    Case("batch_1_bf16", 1, 1000, _ALL_ROWS, "mixed", 48, dtype=torch.bfloat16),
    Case("batch_16", 16, 4096, _ALL_ROWS, "mixed", 12),
    Case("nucleus_256", 256, 4096, ("flat", "peaked", "tied", "ramp"), "nucleus"),
    Case("ties_64", 64, 300, ("tied", "tied_top"), "mixed", 8),
    Case("fallback_0", 64, 1000, ("flat", "peaked", "tied", "ramp"), "nucleus", 4, max_rounds=0),
    Case("fallback_1", 64, 1000, ("flat", "peaked", "tied", "ramp"), "nucleus", 4, max_rounds=1),
    Case("fallback_2", 64, 4096, ("flat", "tied", "ramp"), "nucleus", 2, max_rounds=2),
)


def _row(kind: str, vocab: int, rng: np.random.Generator) -> np.ndarray:
    """One logits row of a kind: near-flat (the bench checkpoint's), peaked, with heavy ties
    (also at the top), mostly -inf, a single finite token, a ramp of distinct near-equal
    values (many rejection rounds) and huge values (most weights underflow to 0)."""
    if kind == "flat":
        return rng.standard_normal(vocab) * 0.2
    if kind == "peaked":
        return rng.standard_normal(vocab) * 3.0
    if kind == "tied":
        return rng.integers(0, 6, vocab) * 0.75
    if kind == "tied_top":
        x = rng.standard_normal(vocab) * 2.0
        x[rng.choice(vocab, 3, replace=False)] = x.max() + 1.0
        return x
    if kind == "masked":
        x = rng.standard_normal(vocab) * 2.0
        x[rng.random(vocab) < 0.95] = -np.inf
        return x
    if kind == "one_left":
        x = np.full(vocab, -np.inf)
        x[rng.integers(vocab)] = 0.5
        return x
    if kind == "ramp":
        return rng.permutation(vocab) * 1e-4
    assert kind == "huge", kind
    return rng.standard_normal(vocab) * 1e4


def _params(mix: str, vocab: int, rng: np.random.Generator) -> SamplingParams:
    """Parameters of one row: the bench's (temperature 0.7, top_p 0.9), top_p with no other
    cut, or any mix of every cut."""
    if mix == "bench":
        return SamplingParams(temperature=0.7, top_p=0.9)
    temperature = float(rng.choice([0.0, 2e-5, 1e-3, 0.1, 0.7, 1.0, 1.0, 1.5]))
    top_p = float(rng.choice([1.0, 0.99, 0.9, 0.5, 0.01]))
    if mix == "nucleus":
        return SamplingParams(temperature=max(temperature, 0.1), top_p=top_p)
    assert mix == "mixed", mix
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=int(rng.choice([-1, -1, -1, 0, 1, 40, vocab])),
        min_p=float(rng.choice([0.0, 0.0, 0.0, 0.05, 0.5])),
    )


def _with_penalties(p: SamplingParams, vocab: int, rng: np.random.Generator) -> SamplingParams:
    return SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        frequency_penalty=float(rng.choice([0.0, 0.5, -0.3])),
        presence_penalty=float(rng.choice([0.0, 0.8])),
        repetition_penalty=float(rng.choice([1.0, 1.3, 0.9])),
        logit_bias=tuple(
            (int(t), float(rng.choice([-100.0, 2.0, 50.0])))
            for t in sorted(rng.choice(vocab, int(rng.integers(0, 3)), replace=False))
        ),
    )


def _banned(batch: int, vocab: int, rng: np.random.Generator) -> BannedTokens:
    """A few ids on some rows (some outside the vocabulary), and every id on one row."""
    rows = rng.integers(0, batch, 3 * batch).astype(np.int64)
    ids = rng.integers(0, vocab + 2, 3 * batch).astype(np.int64)
    every = np.arange(vocab, dtype=np.int64)
    return BannedTokens(
        np.concatenate([rows, np.full(vocab, batch // 2, dtype=np.int64)]),
        np.concatenate([ids, every]),
    )


def _grammar(batch: int, vocab: int, rng: np.random.Generator) -> GrammarMask:
    """Random masks on half the rows, each allowing at least one token."""
    words = -(-vocab // 32)
    bits = rng.integers(-(2**31), 2**31, (batch, words), dtype=np.int64)
    bits &= rng.integers(-(2**31), 2**31, (batch, words), dtype=np.int64)  # about 1 in 4
    bits[:, 0] |= 1
    return GrammarMask(torch.from_numpy(bits.astype(np.int32)), list(range(0, batch, 2)))


def _draw(case: Case, rng: np.random.Generator) -> np.ndarray:
    """One draw of a case: fresh logits, parameters, seeds and counters."""
    n, vocab = case.batch, case.vocab
    kinds = rng.choice(case.rows, n)
    rows = np.stack([_row(str(k), vocab, rng) for k in kinds]).astype(np.float32)
    logits = torch.from_numpy(rows).to(case.dtype)
    params = [_params(case.params, vocab, rng) for _ in range(n)]
    prompts: list[list[int]] = [[] for _ in range(n)]
    outputs: list[list[int]] = [[] for _ in range(n)]
    if "penalties" in case.extras:
        params = [_with_penalties(p, vocab, rng) for p in params]
        prompts = [rng.integers(0, vocab, 8).tolist() for _ in range(n)]
        outputs = [rng.integers(0, vocab, int(rng.integers(0, 12))).tolist() for _ in range(n)]
    seeds = rng.integers(0, 2**63, n, dtype=np.int64).tolist()
    counters = draw_counter(rng.integers(0, 100_000, n), int(rng.integers(0, 3)))
    cols = SamplingColumns.from_requests(
        params,
        seeds,
        counters,
        prompts,
        outputs,
        vocab,
        "cpu",
        banned=_banned(n, vocab, rng) if "banned" in case.extras else None,
        grammar=_grammar(n, vocab, rng) if "grammar" in case.extras else None,
    )
    return sample(logits, cols)


def draw_case(case: Case) -> list[int]:
    """Every draw of a case, concatenated; the generator is seeded by the case's name."""
    rng = np.random.default_rng(list(case.name.encode()))
    old = sampler_module._MAX_ROUNDS
    sampler_module._MAX_ROUNDS = case.max_rounds
    try:
        return np.concatenate([_draw(case, rng) for _ in range(case.draws)]).tolist()
    finally:
        sampler_module._MAX_ROUNDS = old


@pytest.fixture(scope="module")
def golden() -> dict[str, list[int]]:
    recorded: dict[str, list[int]] = json.loads(DATA.read_text())
    return recorded


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_sampler_draws_the_recorded_tokens(case: Case, golden: dict[str, list[int]]) -> None:
    expected = np.array(golden[case.name])
    got = np.array(draw_case(case))
    differ = np.flatnonzero(got != expected)
    assert differ.size == 0, (
        f"{case.name}: {differ.size} of {got.size} tokens differ, first at draw "
        f"{differ[0] // case.batch} row {differ[0] % case.batch}: "
        f"{got[differ[0]]} != {expected[differ[0]]}"
    )


def test_the_record_covers_every_case() -> None:
    recorded = json.loads(DATA.read_text())
    assert set(recorded) == {c.name for c in CASES}
    assert all(len(recorded[c.name]) == c.batch * c.draws for c in CASES)


def _spread(rng: np.random.Generator, m: int, n: int) -> np.ndarray:
    """float32 weights over many magnitudes, with zeros: sums whose rounding shows order."""
    w = rng.random((m, n)) * 10.0 ** rng.integers(-20, 20, (m, n))
    w[rng.random((m, n)) < 0.1] = 0.0
    return w.astype(np.float32)


def test_the_running_sums_add_in_numpys_order() -> None:
    """A token flips when a rounding does: the sampler's float64 running sums (torch's
    cumsum, for speed) must be numpy's sequential sums bit for bit, whatever the threads."""
    rng = np.random.default_rng(5)
    threads = torch.get_num_threads()
    try:
        for n_threads in {1, 2}:
            torch.set_num_threads(n_threads)
            for m, n in ((1, 1), (3, 64), (256, 64), (7, 2376), (64, 1000)):
                w = _spread(rng, m, n)
                np.testing.assert_array_equal(
                    sampler_module._running_sums(w), np.cumsum(w, axis=1, dtype=np.float64)
                )
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("width", [64, 1088, 4096, 8256, 152064])
def test_a_rows_sums_do_not_depend_on_the_rows_beside_it(width: int) -> None:
    """The sampler computes a row's block sums and its nucleus test's masked sum on whatever
    rows need them (all, the top_p rows, the rows a round sends back): each row's bits must
    be the same alone as in any batch."""
    rng = np.random.default_rng(width)
    w = _spread(rng, 6, width)
    above = w > np.median(w, axis=1, keepdims=True)
    masked = np.einsum("ij,ij->i", w, above)
    sums = sampler_module._block_sums(w)
    for i in range(len(w)):
        alone = slice(i, i + 1)
        assert np.einsum("ij,ij->i", w[alone], above[alone])[0] == masked[i]
        np.testing.assert_array_equal(sampler_module._block_sums(w[alone])[0], sums[i])
    np.testing.assert_array_equal(np.einsum("ij,ij->i", w[1::2], above[1::2]), masked[1::2])


def record() -> None:
    """Write the tokens the sampler draws now, one case a line."""
    lines = [f"{json.dumps(c.name)}: {json.dumps(draw_case(c))}" for c in CASES]
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text("{\n" + ",\n".join(lines) + "\n}\n")


if __name__ == "__main__":
    record()
