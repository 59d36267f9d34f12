"""The sampler (docs/design.md section 10): a row's token depends on its own logits,
parameters, seed and counter only; its draws follow the distribution a plain sort-based
implementation defines; bias and penalties match a per-row Python reference."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from statistics import NormalDist

import numpy as np
import pytest
import torch

import scheduler_proc.sampling.sampler as sampler_module
from pipeline.io_struct import SamplingParams
from scheduler_proc.sampling.sampler import (
    SamplingColumns,
    adjusted_logits,
    draw_counter,
    sample,
)


def columns(
    params: Sequence[SamplingParams],
    logits: torch.Tensor,
    *,
    seeds: Sequence[int] | None = None,
    counters: Sequence[int] | np.ndarray | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
) -> SamplingColumns:
    n = len(params)
    return SamplingColumns.from_requests(
        params,
        seeds if seeds is not None else [7] * n,
        list(counters) if counters is not None else [draw_counter(0)] * n,
        prompts if prompts is not None else [[]] * n,
        outputs if outputs is not None else [[]] * n,
        logits.shape[-1],
        logits.device,
    )


# --- references: plain per-row Python and numpy with a full sort ---------------------------


def reference_adjusted(
    row: Sequence[float], p: SamplingParams, prompt: Sequence[int], output: Sequence[int]
) -> list[float]:
    x = [float(v) for v in row]
    for token, bias in p.logit_bias:
        x[token] += bias
    for token, count in Counter(output).items():
        x[token] -= p.frequency_penalty * count + p.presence_penalty
    for token in set(prompt) | set(output):
        x[token] = (
            x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
        )
    return x


def reference_probs(row: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Probabilities after temperature, top_k, top_p and min_p, by a full sort."""
    vocab = len(row)
    order = np.argsort(-row, kind="stable")
    probs = np.exp((row[order] - row[order[0]]) / p.temperature)
    if 0 < p.top_k < vocab:
        probs[p.top_k :] = 0.0
    probs /= probs.sum()
    if p.top_p < 1.0:
        before = np.cumsum(probs) - probs
        probs[(before >= p.top_p) & (np.arange(vocab) > 0)] = 0.0
    probs[probs < p.min_p * probs[0]] = 0.0
    out = np.zeros(vocab)
    out[order] = probs / probs.sum()
    return out


def chi_square_critical(df: int, p_value: float = 0.001) -> float:
    """Wilson–Hilferty's approximation of the chi-square quantile."""
    z = NormalDist().inv_cdf(1.0 - p_value)
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * c**0.5) ** 3


# --- reproducibility -------------------------------------------------------------------------

VOCAB = 1000  # not a multiple of the sampler's block width: the padding is exercised too
_FLAT = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3)) * 0.05


def _subjects() -> list[tuple[SamplingParams, torch.Tensor, list[int], list[int]]]:
    g = torch.Generator().manual_seed(0)
    peaked = torch.randn(9, VOCAB, generator=g) * 3
    prompt, output = [1, 2, 3, 50, 50, 999], [4, 50, 4, 4, 7]
    return [
        (SamplingParams(temperature=0.8), peaked[0], prompt, output),
        (SamplingParams(temperature=1.0, top_k=40), peaked[1], prompt, output),
        (SamplingParams(temperature=0.7, top_p=0.8), peaked[2], prompt, output),
        (
            SamplingParams(temperature=0.7, top_p=0.9),
            _FLAT[0],
            prompt,
            output,
        ),  # many rejection rounds
        (SamplingParams(temperature=1.2, min_p=0.05), peaked[3], prompt, output),
        (
            SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.02),
            peaked[4],
            prompt,
            output,
        ),
        (
            SamplingParams(temperature=0.8, frequency_penalty=0.7, presence_penalty=0.4),
            peaked[5],
            prompt,
            output,
        ),
        (SamplingParams(temperature=0.8, repetition_penalty=1.5), peaked[6], prompt, output),
        (
            SamplingParams(temperature=0.8, logit_bias=((4, 3.0), (17, -5.0))),
            peaked[7],
            prompt,
            output,
        ),
        (
            SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias=((9, 1.0),)),
            peaked[8],
            prompt,
            output,
        ),
    ]


def _neighbour(rng: random.Random) -> SamplingParams:
    return rng.choice(
        [
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.5),
            SamplingParams(temperature=1.0, top_k=rng.choice([1, 5, 40, 500])),
            SamplingParams(temperature=1.0, top_p=rng.choice([0.1, 0.5, 0.95])),
            SamplingParams(temperature=1.0, min_p=0.3),
            SamplingParams(temperature=0.7, frequency_penalty=1.0, repetition_penalty=0.8),
            SamplingParams(temperature=0.0, logit_bias=((5, 100.0),)),
        ]
    )


def test_a_seeded_row_draws_the_same_alone_or_in_any_batch() -> None:
    """Neighbours of every kind (greedy, other cuts, penalties, bias), any batch size and
    position: batch-level decisions (which paths run, whether penalties are applied at all,
    the topk width) never change a row's token."""
    subjects = _subjects()
    counters = range(6)
    alone = {}
    for i, (p, row, prompt, output) in enumerate(subjects):
        for c in counters:
            cols = columns(
                [p],
                row[None],
                seeds=[100 + i],
                counters=[draw_counter(c)],
                prompts=[prompt],
                outputs=[output],
            )
            alone[i, c] = int(sample(row[None], cols)[0])
    rng = random.Random(0)
    for size in (len(subjects), 16, 33, 64):
        for _ in range(3):
            c = rng.choice(counters)
            entries: list[
                tuple[int | None, SamplingParams, torch.Tensor, int, list[int], list[int]]
            ] = [
                (i, p, row, 100 + i, prompt, output)
                for i, (p, row, prompt, output) in enumerate(subjects)
            ]
            while len(entries) < size:
                row = torch.randn(VOCAB) * rng.choice([0.1, 2.0, 5.0])
                entries.append(
                    (
                        None,
                        _neighbour(rng),
                        row,
                        rng.getrandbits(63),
                        [8, 9],
                        [rng.randrange(VOCAB)],
                    )
                )
            rng.shuffle(entries)
            logits = torch.stack([e[2] for e in entries])
            cols = columns(
                [e[1] for e in entries], logits, seeds=[e[3] for e in entries],
                counters=[draw_counter(c)] * size, prompts=[e[4] for e in entries],
                outputs=[e[5] for e in entries],
            )  # fmt: skip
            got = sample(logits, cols)
            for pos, entry in enumerate(entries):
                if entry[0] is not None:
                    assert got[pos] == alone[entry[0], c], (entry[1], size, c)


def test_every_counter_is_drawn_independently() -> None:
    """Counter c drawn alone equals its value in a batch of consecutive counters: a draw is
    a function of (seed, counter), not of a generator's history."""
    for p, row, _, _ in _subjects()[:6]:
        n = 20
        sequence = sample(
            row.expand(n, -1), columns([p] * n, row[None], counters=draw_counter(np.arange(n)))
        )
        for c in (0, 5, 19):
            assert (
                sample(row[None], columns([p], row[None], counters=[draw_counter(c)]))[0]
                == sequence[c]
            ), p
        assert len(set(sequence.tolist())) > 3, f"sampling should vary from counter to counter: {p}"


def test_draw_counter_packs_the_output_index_and_the_pass() -> None:
    assert draw_counter(0) == 0
    assert draw_counter(5) == 5 * 65536
    assert draw_counter(5, 3) == 5 * 65536 + 3
    assert draw_counter(np.arange(3), 1).tolist() == [1, 65537, 131073]
    with pytest.raises(ValueError, match="pass_index"):
        draw_counter(1, 65536)


def test_different_seeds_draw_differently() -> None:
    row = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5)) * 2
    p = SamplingParams(temperature=1.0)
    n = 20
    tokens = sample(row.expand(n, -1), columns([p] * n, row, seeds=list(range(n))))
    assert len(set(tokens.tolist())) > 3


# --- the distribution ------------------------------------------------------------------------

DRAWS = 20000
_PEAKED = torch.randn(1, 300, generator=torch.Generator().manual_seed(11)) * 2.5
_NEAR_UNIFORM = torch.randn(1, 300, generator=torch.Generator().manual_seed(12)) * 0.3

DISTRIBUTIONS = {
    "plain": (_PEAKED, SamplingParams(temperature=0.9)),
    "top_k": (_PEAKED, SamplingParams(temperature=1.3, top_k=20)),
    "top_p": (_PEAKED, SamplingParams(temperature=1.0, top_p=0.8)),
    "top_p near-uniform": (_NEAR_UNIFORM, SamplingParams(temperature=0.7, top_p=0.6)),
    "min_p": (_PEAKED, SamplingParams(temperature=1.5, min_p=0.05)),
    "top_p and min_p": (_PEAKED, SamplingParams(temperature=1.5, top_p=0.7, min_p=0.01)),
    "top_k and top_p": (_PEAKED, SamplingParams(temperature=1.1, top_k=30, top_p=0.7)),
}


@pytest.mark.parametrize(
    ("name", "max_rounds"),
    [(name, 32) for name in DISTRIBUTIONS]
    + [(name, 0) for name, (_, p) in DISTRIBUTIONS.items() if p.top_p < 1.0],
)
def test_draws_follow_the_reference_distribution(
    name: str, max_rounds: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20000 draws of one row, each with its own counter, against a sort-based reference:
    chi-square at p = 0.001 (a fixed seed, so the outcome is fixed), and never a token the
    cuts remove. ``max_rounds=0`` sends every top_p row the rejection turns down to the
    exact sort instead."""
    monkeypatch.setattr(sampler_module, "_MAX_ROUNDS", max_rounds)
    row, p = DISTRIBUTIONS[name]
    expected = reference_probs(row[0].double().numpy(), p) * DRAWS
    tokens = sample(
        row.expand(DRAWS, -1),
        columns([p] * DRAWS, row, seeds=[2024] * DRAWS, counters=draw_counter(np.arange(DRAWS))),
    )
    observed = np.bincount(tokens, minlength=row.shape[-1])

    assert observed[expected == 0].sum() == 0, (
        f"cut tokens drawn: {np.flatnonzero(observed * (expected == 0))}"
    )
    big = expected >= 5  # chi-square needs enough expected per bin: the small ones share one
    obs_bins = np.append(observed[big], observed[~big].sum())
    exp_bins = np.append(expected[big], expected[~big].sum())
    if exp_bins[-1] < 5:
        obs_bins, exp_bins = obs_bins[:-1], exp_bins[:-1]
        obs_bins[-1] += observed[~big].sum()
        exp_bins[-1] += expected[~big].sum()
    statistic = float(((obs_bins - exp_bins) ** 2 / exp_bins).sum())
    df = len(exp_bins) - 1
    assert df >= 5, "the test needs a spread-out distribution"
    assert statistic < chi_square_critical(df), (name, statistic, df)


# --- bias and penalties ----------------------------------------------------------------------


def test_bias_and_penalties_match_a_per_row_reference() -> None:
    g = torch.Generator().manual_seed(21)
    vocab = 50
    cases = [
        SamplingParams(),
        SamplingParams(frequency_penalty=0.6),
        SamplingParams(presence_penalty=-0.8),
        SamplingParams(frequency_penalty=1.5, presence_penalty=0.5),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(repetition_penalty=0.7),
        SamplingParams(logit_bias=((0, 100.0), (3, -2.5), (49, 0.25))),
        SamplingParams(temperature=0.0),
        SamplingParams(
            frequency_penalty=0.3,
            presence_penalty=0.2,
            repetition_penalty=1.2,
            logit_bias=((7, -100.0), (8, 4.0)),
        ),
    ]
    rows = len(cases)
    logits = torch.randn(rows, vocab, generator=g) * 3
    prompts = [torch.randint(0, vocab, (12,), generator=g).tolist() for _ in range(rows)]
    outputs = [torch.randint(0, vocab, (9,), generator=g).tolist() + [3, 3, 3] for _ in range(rows)]
    want = torch.tensor(
        [
            reference_adjusted(logits[i].tolist(), cases[i], prompts[i], outputs[i])
            for i in range(rows)
        ],
        dtype=torch.float64,
    )
    cols = columns(cases, logits, prompts=prompts, outputs=outputs)
    got = adjusted_logits(logits, cols).double()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[0], logits[0].double()), (
        "a row that asks nothing is left exactly as it was"
    )
    # Each row alone: the same values (the rows that ask are picked out as a subset).
    for i in range(rows):
        alone = columns(
            cases[i : i + 1],
            logits[i : i + 1],
            prompts=prompts[i : i + 1],
            outputs=outputs[i : i + 1],
        )
        assert torch.equal(adjusted_logits(logits[i : i + 1], alone)[0], got[i].float()), cases[i]
    # Greedy rows see them too.
    greedy = [
        SamplingParams(temperature=0.0, **{f: getattr(p, f) for f in _PENALTY_FIELDS})
        for p in cases
    ]
    tokens = sample(logits, columns(greedy, logits, prompts=prompts, outputs=outputs))
    assert tokens.tolist() == want.argmax(dim=1).tolist()


_PENALTY_FIELDS = ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias")


def test_no_penalty_tensor_is_built_when_no_row_asks() -> None:
    logits = torch.zeros(2, 10)
    cols = columns([SamplingParams(), SamplingParams(temperature=0.0)], logits, outputs=[[1], [2]])
    assert cols.output_counts is None and cols.seen is None and cols.logit_bias is None


# --- limits that reduce to greedy --------------------------------------------------------------


def test_limits_that_leave_one_token_are_greedy() -> None:
    """top_k=1, min_p 0.999, and a top_p too small for float32 (the first token always
    survives) all draw the argmax; a +100 logit_bias forces its token, greedy or sampled."""
    logits = torch.randn(8, 4096, generator=torch.Generator().manual_seed(31)) * 2
    argmax = logits.argmax(dim=1).numpy()
    n = 40
    for p in (
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, min_p=0.999),
        SamplingParams(temperature=1.0, top_p=5e-324),
        SamplingParams(temperature=1.0, top_p=1e-46),
    ):
        for c in range(n):
            cols = columns([p] * len(logits), logits, counters=[draw_counter(c)] * len(logits))
            assert (sample(logits, cols) == argmax).all(), (p, c)
    for p in (
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_p=0.5),
    ):
        forced = SamplingParams(
            **{
                **{f: getattr(p, f) for f in ("temperature", "top_p")},
                "logit_bias": ((123, 100.0),),
            }
        )
        for c in range(n):
            cols = columns([forced] * len(logits), logits, counters=[draw_counter(c)] * len(logits))
            assert (sample(logits, cols) == 123).all(), (forced, c)


# --- banned tokens (min_new_tokens) ------------------------------------------------------------


def test_banned_tokens_are_never_drawn_and_the_logits_stay_raw() -> None:
    """Every kind of row with its token 5 pushed far ahead: a row that bans it never draws
    it (the ban comes after the bias), a row that does not draws nothing else, and the
    caller's logits (the logprobs' source) are left as they were."""
    vocab, n = 300, 40
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=10),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=0.0, logit_bias=((5, 100.0),)),
        SamplingParams(temperature=1.0, logit_bias=((5, 100.0),), frequency_penalty=0.5),
    ]
    params = kinds * 2
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(41))
    logits[:, 5] += 30.0
    raw = logits.clone()
    rows = np.arange(len(kinds), dtype=np.int64)  # the first copy of each kind bans 5 and 6
    banned = sampler_module.BannedTokens(
        np.repeat(rows, 2), np.tile(np.array([5, 6], dtype=np.int64), len(kinds))
    )
    for c in range(n):
        cols = SamplingColumns.from_requests(
            params, [3] * len(params), [draw_counter(c)] * len(params), [[]] * len(params),
            [[1]] * len(params), vocab, "cpu", banned,
        )  # fmt: skip
        got = sample(logits, cols)
        assert not np.isin(got[: len(kinds)], [5, 6]).any(), (c, got)
        assert (got[len(kinds) :] == 5).all(), (c, got)
        # A banned row draws what it draws alone: the ban is its own.
        for i in (1, 3):
            alone = SamplingColumns.from_requests(
                [params[i]], [3], [draw_counter(c)], [[]], [[1]], vocab, "cpu",
                sampler_module.BannedTokens(np.zeros(2, dtype=np.int64),
                    np.array([5, 6], dtype=np.int64)),
            )  # fmt: skip
            assert sample(logits[i : i + 1], alone)[0] == got[i]
    assert torch.equal(logits, raw), "the ban wrote into the caller's logits"


def test_a_row_whose_every_token_is_banned_still_draws_one() -> None:
    """No NaN weights: it draws among the banned tokens; ids the vocabulary lacks are
    ignored."""
    vocab = 64
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(43))
    banned = sampler_module.BannedTokens(
        np.zeros(vocab + 1, dtype=np.int64), np.arange(vocab + 1, dtype=np.int64)
    )
    every_kind = (
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=0.5, top_k=5),
    )
    for p in every_kind:
        cols = SamplingColumns.from_requests(
            [p, p], [1, 1], [draw_counter(0)] * 2, [[], []], [[], []], vocab, "cpu", banned
        )
        got = sample(logits, cols)
        assert 0 <= got[0] < vocab, (p, got)
        assert got[1] == sample(logits[1:], columns([p], logits[1:], seeds=[1]))[0], (
            "the neighbour of such a row is untouched"
        )
