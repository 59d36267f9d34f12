"""Unseeded sampling keeps the target's distribution with speculative decoding (issue 42's
proof): 2,000 unseeded samples of the first 3 tokens, from a plain server and from servers
drafting with prompt lookup and with a draft model, each pass a chi-square goodness-of-fit
test at p = 0.01 against the exact distribution, which the plain server's top logprobs give
(temperature 0.1 over the top 8 tokens: a few sequences hold most of the mass).

The prompt ends inside the model's own greedy loop, so prompt lookup drafts the likeliest
tokens and many drafts are accepted (checked). A correct sampler fails one test at p = 0.01
in 100 runs: so a rejected sample is drawn again, and only a second rejection fails (1 run
in 10,000 for a correct one; a biased sampler fails both)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from pipeline.tokenizer_loader import load_tokenizer
from tests.server_harness import ServerProcess
from tests.speculative_helpers import (
    ALWAYS,
    DETERMINISTIC,
    SpecCounts,
    chi_square_sf,
    generate,
    ngram_args,
    standalone_args,
    total_counts,
    write_layer_draft,
    write_target,
)

SAMPLES = 2000
TOKENS = 3
TOP_K = 8
TEMPERATURE = 0.1
ALPHA = 0.01
MIN_EXPECTED = 5.0  # cells expected fewer times are pooled (the chi-square approximation)
SEED_TEXT = "def f(x): return x + 1\n"  # greedy: 16 tokens, then one token over and over
SAMPLING = {"temperature": TEMPERATURE, "top_k": TOP_K, "ignore_eos": True}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    root = tmp_path_factory.mktemp("speculative-distribution")
    write_target(root / "target")
    write_layer_draft(root / "target", root / "draft")
    common = ["--model-path", str(root / "target"), *DETERMINISTIC, "--torch-threads", "1"]
    # The draft model reads a new row's prompt within this budget per step: all 256 rows of
    # a batch at once, so each drafts from its first decode step on.
    common += ["--chunked-prefill-size", "16384"]
    flags = {
        "plain": [],
        "ngram": [*ngram_args(), *ALWAYS],
        "standalone": [*standalone_args(root / "draft"), *ALWAYS],
    }
    started = {
        name: ServerProcess(root / name / "tmp", [*common, *args]) for name, args in flags.items()
    }
    try:
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        with ThreadPoolExecutor(len(started)) as pool:
            list(pool.map(ServerProcess.stop, started.values()))


@pytest.fixture(scope="module")
def prompt(servers: dict[str, ServerProcess]) -> list[int]:
    """The seed text and 24 greedy tokens of it: deep in the loop."""
    ids = load_tokenizer(None).encode(SEED_TEXT)
    with servers["plain"].client() as client:
        body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 24}}
        greedy = generate(client, body)["output_ids"]
    assert len(set(greedy[-8:])) <= 2, f"the greedy text no longer loops: {greedy}"
    return ids + greedy


def next_token_probabilities(
    server: ServerProcess, prefixes: list[list[int]]
) -> list[dict[int, float]]:
    """For each prefix, the sampler's distribution of the next token: the top 8 raw logprobs
    (the log-softmax differs from the logits by a constant), divided by the temperature and
    normalised over those 8."""
    body = {
        "input_ids": prefixes,
        "sampling_params": {"temperature": 0, "max_new_tokens": 1},
        "return_logprob": True,
        "top_logprobs_num": TOP_K,
    }
    with server.client() as client:
        answers = generate(client, body)
    out = []
    for answer in answers:
        top = answer["meta_info"]["output_top_logprobs"][0]
        scaled = {token: logprob / TEMPERATURE for logprob, token, _ in top}
        peak = max(scaled.values())
        weights = {token: math.exp(v - peak) for token, v in scaled.items()}
        total = sum(weights.values())
        out.append({token: w / total for token, w in weights.items()})
    return out


@pytest.fixture(scope="module")
def exact(servers: dict[str, ServerProcess], prompt: list[int]) -> dict[tuple[int, ...], float]:
    """The probability of every 3-token sequence the sampler can draw (8**3 of them)."""
    probabilities: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(TOKENS):
        prefixes = list(probabilities)
        nexts = next_token_probabilities(servers["plain"], [prompt + list(p) for p in prefixes])
        probabilities = {
            (*prefix, token): probabilities[prefix] * p
            for prefix, dist in zip(prefixes, nexts)
            for token, p in dist.items()
        }
    assert math.isclose(sum(probabilities.values()), 1.0, rel_tol=1e-9)
    return probabilities


def draw(server: ServerProcess, prompt: list[int]) -> tuple[Counter[tuple[int, ...]], SpecCounts]:
    """2,000 unseeded samples of the first 3 tokens, and their speculation counts."""
    sampled: Counter[tuple[int, ...]] = Counter()
    metas = []
    with server.client() as client:
        for _ in range(SAMPLES // 1000):
            body = {
                "input_ids": [prompt] * 1000,
                "sampling_params": {**SAMPLING, "max_new_tokens": TOKENS},
            }
            for answer in generate(client, body):
                sampled[tuple(answer["output_ids"])] += 1
                metas.append(answer["meta_info"])
    return sampled, total_counts(metas)


def goodness_of_fit(
    sampled: Counter[tuple[int, ...]], exact: dict[tuple[int, ...], float]
) -> tuple[float, float, int]:
    """(statistic, p-value, degrees of freedom) of Pearson's test of ``sampled`` against
    ``exact``, the cells expected fewer than 5 times pooled into one (itself joined to the
    smallest kept cell while it is expected fewer than 5 times)."""
    outside = {seq: n for seq, n in sampled.items() if seq not in exact}
    if outside:
        most = sorted(outside.items(), key=lambda kv: -kv[1])[:8]
        pytest.fail(f"{len(outside)} sequences drawn outside the top {TOP_K}, as {most}")
    total = sum(sampled.values())
    ranked = sorted(exact, key=exact.__getitem__, reverse=True)
    kept = [seq for seq in ranked if exact[seq] * total >= MIN_EXPECTED]
    pooled = [seq for seq in ranked if exact[seq] * total < MIN_EXPECTED]
    cells = [[seq] for seq in kept]
    if pooled:
        if sum(exact[s] for s in pooled) * total >= MIN_EXPECTED:
            cells.append(pooled)
        else:
            cells[-1].extend(pooled)
    statistic = 0.0
    for cell in cells:
        expected = total * sum(exact[s] for s in cell)
        observed = sum(sampled[s] for s in cell)
        statistic += (observed - expected) ** 2 / expected
    dof = len(cells) - 1
    return statistic, chi_square_sf(statistic, dof), dof


def test_the_exact_distribution_spreads_over_many_sequences(
    exact: dict[tuple[int, ...], float],
) -> None:
    """A test with power: the likeliest sequence is far from certain, and at least 10 cells
    are expected 5 times or more in 2,000 draws."""
    ranked = sorted(exact.values(), reverse=True)
    assert ranked[0] < 0.5, ranked[:5]
    assert sum(p * SAMPLES >= MIN_EXPECTED for p in ranked) >= 10, ranked[:12]


@pytest.mark.parametrize("name", ["plain", "ngram", "standalone"])
def test_unseeded_samples_follow_the_targets_distribution(
    servers: dict[str, ServerProcess],
    prompt: list[int],
    exact: dict[tuple[int, ...], float],
    name: str,
) -> None:
    results = []
    for _ in range(2):
        sampled, counts = draw(servers[name], prompt)
        if name != "plain":
            assert counts.accepted_tokens > SAMPLES // 10, f"too few accepted to test: {counts}"
        statistic, p_value, dof = goodness_of_fit(sampled, exact)
        results.append((statistic, p_value, dof, sampled.most_common(5)))
        if p_value >= ALPHA:
            return
    pytest.fail(f"rejected twice at p = {ALPHA}: {results}")


def test_a_chi_square_p_value_is_the_tables() -> None:
    """The p-value routine against values every table gives."""
    for statistic, dof, p_value in ((3.841, 1, 0.05), (6.635, 1, 0.01), (21.666, 9, 0.01)):
        assert math.isclose(chi_square_sf(statistic, dof), p_value, rel_tol=2e-3)
    assert math.isclose(
        chi_square_sf(2 * 10.0, 2 * 10),
        sum(math.exp(-10.0) * 10.0**k / math.factorial(k) for k in range(10)),
        rel_tol=1e-12,
    )
