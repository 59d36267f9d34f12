"""Smoke test of bench/serve.py --speculative JSON --compare-speculative against the servers it
launches itself (one speculating, one not) on the copy checkpoint it writes: tiny numbers;
checks the JSON, that the printed table comes from the runs and that the speculating server's
/metrics counted drafts the copy checkpoint's answers accept. It does not judge the timings
(a shared CI machine says nothing about them). Also the pieces without a server: the copy
checkpoint's permutation, the chain prompts and the reading of the counters."""

from __future__ import annotations

import importlib
import json
import math
import random
import statistics
from pathlib import Path
from types import ModuleType

import pytest

from bench.copy_checkpoint import CYCLE_MAX, CYCLE_MIN, cycle_successors
from bench.serve_client import FIRST_ID, PROMPT_HEAD, chain_prompt
from bench.serve_speculative import SpecTotals, parse_totals, spec_figures

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
NGRAM += '"prompt_lookup_max": 3}'


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    pytest.importorskip("tqdm")
    pytest.importorskip("matplotlib")
    return importlib.import_module("bench.serve")


@pytest.mark.timeout(180)
def test_compare_speculative_reports_both_arms_and_the_acceptance(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    argv = ["--launch", "--concurrency", "1", "--requests", "3", "--max-new-tokens", "24"]
    argv += ["--speculative", NGRAM, "--compare-speculative", "--spec-workload", "repeat"]
    argv += ["--no-progress", "--json", str(out), "--server-args", "--max-total-tokens 4096"]
    assert bench.main(argv) == 0

    r = json.loads(out.read_text())
    assert r["config"]["temperature"] == 0.0 and len(r["config"]["prompt_chain"]) == 4096
    assert r["errors"] == 0 and r["tokens_lost"] == 0 and r["output_tokens"] == 3 * 24
    s = r["speculative"]
    assert s["workload"] == "repeat" and json.loads(s["speculative_config"])["method"] == "ngram"
    assert s["errors"] == 0 and s["tokens_lost"] == 0
    assert [row["first"] for row in s["rounds"]] == ["plain", "spec"]
    for row in s["rounds"]:
        assert row["plain"]["output_tokens"] == row["spec"]["output_tokens"] == 3 * 24
        tps = row["spec"]["output_tokens_per_s"] / row["plain"]["output_tokens_per_s"]
        assert row["ratio"] == pytest.approx(tps)
    assert s["ratio"] == pytest.approx(statistics.median(row["ratio"] for row in s["rounds"]))
    assert 0 < s["plain_output_tokens_per_s"] < math.inf
    assert 0 < s["spec_output_tokens_per_s"] < math.inf

    m = s["metrics"]
    # The copy checkpoint's greedy answer goes on round the cycle its chain prompt holds, so
    # nearly every draft the prompt lookup makes is the target's own next token.
    assert m["drafts"] > 0 and m["draft_tokens"] >= m["drafts"]
    assert m["acceptance_rate"] == pytest.approx(m["accepted_tokens"] / m["draft_tokens"])
    assert m["acceptance_rate"] > 0.9
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["accepted_tokens"] / m["drafts"])
    per_pos = m["accepted_per_pos"]
    assert len(per_pos) == 3 and sum(per_pos) == m["accepted_tokens"]
    assert m["drafts"] >= per_pos[0] >= per_pos[1] >= per_pos[2] > 0
    # Two rounds of 3 requests of 24 tokens on the speculating server: each token is the
    # target's own or an accepted draft, and each verify pass yields one of the target's.
    assert m["accepted_tokens"] < 2 * 3 * 24

    table = capsys.readouterr().out
    for label in ("plain against speculative", "plain tok/s", "spec tok/s", "spec/plain"):
        assert label in table
    for row in s["rounds"]:
        assert f"{row['spec']['output_tokens_per_s']:14.1f}" in table
    assert f"median{s['plain_output_tokens_per_s']:24.1f}" in table
    assert f"{s['ratio']:10.3f}x  target >= 2.0x at concurrency 1: " in table
    assert "PASS" in table or "FAIL" in table
    assert f"acceptance rate {m['acceptance_rate']:.3f}" in table
    assert f"mean acceptance length {m['mean_acceptance_length']:.3f}" in table
    assert f"1: {per_pos[0]} ({per_pos[0] / m['drafts']:.3f})" in table
    for name in ("plain", "spec"):
        rates = [row[name]["scheduler_steps"]["steps_per_s"] for row in s["rounds"]]
        assert s["steps_per_s"][name] == pytest.approx(statistics.median(rates))
        assert f"{name} {s['steps_per_s'][name]:.1f}" in table
    per_cpu_s = [
        {
            name: row[name]["cpu"]["tokens_in_window"]
            / row[name]["cpu"]["processes"]["scheduler"]["cpu_s"]
            for name in ("plain", "spec")
        }
        for row in s["rounds"]
        # A run shorter than the clock tick can read no scheduler CPU: then no ratio.
        if all(
            row[name]["cpu"]["processes"]["scheduler"]["cpu_s"] > 0 for name in ("plain", "spec")
        )
    ]
    if len(per_cpu_s) == len(s["rounds"]):
        cpu_ratio = statistics.median(x["spec"] / x["plain"] for x in per_cpu_s)
        assert s["scheduler_cpu_ratio"] == pytest.approx(cpu_ratio)
        assert f"(median over rounds): {s['scheduler_cpu_ratio']:.3f}x" in table
    else:
        assert s["scheduler_cpu_ratio"] is None


def test_speculative_flags_are_checked(bench: ModuleType) -> None:
    for argv in (
        ["--compare-speculative"],  # needs --speculative
        ["--speculative", NGRAM],  # needs --launch
        ["--launch", "--speculative", "[1]"],  # not an object
        ["--launch", "--speculative", NGRAM, "--server-args", "--speculative-algorithm NGRAM"],
        ["--launch", "--speculative", NGRAM, "--api", "chat"],  # repeat sends token ids
        ["--launch", "--speculative", NGRAM, "--server-args", "--model-path /nonexistent"],
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)


def test_cycle_permutation_and_chain_prompts() -> None:
    successors = cycle_successors(4096, seed=3)
    assert sorted(successors) == list(range(4096))
    assert successors[:FIRST_ID] == list(range(FIRST_ID))
    seen: set[int] = set()
    for start in range(FIRST_ID, 4096):
        if start in seen:
            continue
        cycle = [start]
        while successors[cycle[-1]] != start:
            cycle.append(successors[cycle[-1]])
        assert CYCLE_MIN <= len(cycle) <= CYCLE_MAX
        seen.update(cycle)
    ids = chain_prompt(successors, random.Random(0), 32)
    assert len(ids) == 32 and min(ids) >= FIRST_ID
    chain = ids[PROMPT_HEAD:]
    assert all(successors[a] == b for a, b in zip(chain, chain[1:]))


def test_counters_read_from_metrics_and_their_growth() -> None:
    def text(drafts: int, tokens: int, accepted: int, pos: list[int]) -> str:
        labels = 'model_name="m",engine="0"'
        lines = [
            "# TYPE vllm:spec_decode_num_drafts_total counter",
            f"vllm:spec_decode_num_drafts_total{{{labels}}} {drafts}.0",
            f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {tokens}.0",
            f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {accepted}.0",
            "vllm:spec_decode_num_accepted_tokens_created{} 1.7e9",
        ]
        lines += [
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{j}"}} {n}.0'
            for j, n in enumerate(pos)
        ]
        return "\n".join(lines)

    before = parse_totals(text(10, 40, 30, [10, 8, 7, 5]))
    assert before == SpecTotals(10, 40, 30, (10, 8, 7, 5))
    assert parse_totals("tokenpipe:requests_total 3.0") == SpecTotals()
    m = spec_figures(before, parse_totals(text(30, 110, 70, [28, 20, 14, 8])))
    assert (m["drafts"], m["draft_tokens"], m["accepted_tokens"]) == (20, 70, 40)
    assert m["acceptance_rate"] == pytest.approx(40 / 70)
    assert m["mean_acceptance_length"] == pytest.approx(3.0)
    assert m["accepted_per_pos"] == [18, 12, 7, 3]
    assert m["accepted_per_pos_rate"] == pytest.approx([0.9, 0.6, 0.35, 0.15])
    none = spec_figures(SpecTotals(), SpecTotals())
    assert none["acceptance_rate"] is None and none["mean_acceptance_length"] is None
