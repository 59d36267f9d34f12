"""Seeded sampling is reproducible per request, whatever the request is batched with."""

from __future__ import annotations

import torch

from pipeline.io_struct import SamplingParams
from scheduler_proc.req import Req
from scheduler_proc.sampler import sample


def req(seed: int, **params: object) -> Req:
    params = {"temperature": 0.8, **params}
    return Req(
        rid=f"s{seed}", req_id=seed, input_ids=[1], sampling=SamplingParams(seed=seed, **params),  # type: ignore[arg-type]
        stream=True, stream_interval=1, arrival_time=0.0,
    )  # fmt: skip


def draws(reqs: list[Req], logits: torch.Tensor, steps: int = 20) -> list[list[int]]:
    return [sample(logits, reqs) for _ in range(steps)]


def test_same_seed_same_tokens_alone_or_batched() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 4096) * 3
    for params in ({}, {"top_k": 40}, {"top_p": 0.8}):
        alone = [row[0] for row in draws([req(7, **params)], logits[1:2])]
        batched = [row[1] for row in draws([req(1, **params), req(7, **params), req(9)], logits)]
        assert alone == batched, params
        assert len(set(alone)) > 3, "sampling should vary from step to step"


def test_top_k_one_is_greedy_and_top_p_cuts_the_tail() -> None:
    logits = torch.zeros(1, 4096)
    logits[0, 123] = 20.0
    logits[0, 7] = 19.0
    assert {t for row in draws([req(3, top_k=1)], logits) for t in row} == {123}
    assert {t for row in draws([req(4, top_p=0.5)], logits, 50) for t in row} == {123}


def test_a_seeded_row_ignores_whether_a_neighbour_has_cuts() -> None:
    """A row without cuts beside a top_p or top_k row draws what it draws alone (the sorted
    path was once taken for the whole batch, so 20 of 20 seeds changed)."""
    torch.manual_seed(1)
    logits = torch.randn(2, 4096) * 2
    for seed in range(20):
        alone = [row[0] for row in draws([req(seed, temperature=1.0)], logits[:1], 8)]
        for neighbour in ({"top_p": 0.9}, {"top_k": 50}):
            mixed = [row[0] for row in draws([req(seed, temperature=1.0), req(1000 + seed, **neighbour)], logits, 8)]
            assert mixed == alone, (seed, neighbour)
        # And the other way round: a cut row beside an uncut one draws what it draws alone.
        cut_alone = [row[0] for row in draws([req(seed, top_p=0.9)], logits[1:], 8)]
        cut_mixed = [row[1] for row in draws([req(2000 + seed), req(seed, top_p=0.9)], logits, 8)]
        assert cut_mixed == cut_alone, seed
