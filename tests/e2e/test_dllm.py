"""``--mode dllm``: block diffusion decoding, in-process step by step, then end to end."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from pipeline.server_args import check_config
from pipeline.config import ServerConfig
from pipeline.io_struct import (
    COUNT_DTYPE,
    REQ_ID_DTYPE,
    AbortReq,
    FinishAbort,
    FinishLength,
    FinishStop,
    RequestOutputStats,
    SamplingParams,
    TokenizedGenerateReqInput,
)
from pipeline.columns import from_column, split_token_rows
from pipeline.tokenizer_loader import load_tokenizer
from scheduler_proc.main import build_scheduler
from scheduler_proc.req import Req
from scheduler_proc.scheduler import Scheduler
from tests.server_harness import ServerProcess
from tests.unit.test_dllm_logprobs import reference_decode

B, S = 4, 2  # block size, refinement passes per block
PROMPTS = [[(13 * i + 7 * k + 5) % 4000 + 50 for i in range(12 + 5 * k)] for k in range(6)]


def make(pool: int = 4096, block: int = B, steps: int = S, chunk: int = 512) -> Scheduler:
    return build_scheduler(
        ServerConfig(
            mode="dllm",
            dllm_block_size=block,
            dllm_steps=steps,
            max_total_tokens=pool,
            chunked_prefill_size=chunk,
            torch_threads=1,
        )
    )


def submit(
    s: Scheduler,
    req_id: int,
    ids: list[int],
    *,
    max_new: int = 12,
    stream: bool = True,
    **sampling: object,
) -> None:
    params = {"temperature": 0.0, "ignore_eos": True, **sampling}
    s.add_request(
        TokenizedGenerateReqInput(
            rid=f"r{req_id}",
            req_id=req_id,
            input_ids=ids,
            sampling_params=SamplingParams(
                max_new_tokens=max_new,
                **params,  # type: ignore[arg-type]
            ),
            stream=stream,
            arrival_time=time.time(),
        )
    )


class Row(msgspec.Struct):
    step: int
    tokens: list[int]
    completion: int
    stats: RequestOutputStats | None
    finish: object


def run(
    s: Scheduler, *, until: int | None = None, at_step: dict[int, object] | None = None
) -> dict[int, list[Row]]:
    """Rows per req_id (through a msgpack round trip); ``at_step[n]()`` runs before step n."""
    rows: dict[int, list[Row]] = {}
    step = 0
    pending = dict(at_step or {})
    while (s.has_work() or pending) and (until is None or step < until):
        step += 1
        if step in pending:
            pending.pop(step)()  # type: ignore[operator]
        for frame in s.step():
            frame = msgspec.msgpack.decode(msgspec.msgpack.encode(frame), type=type(frame))
            ids = from_column(frame.req_ids, REQ_ID_DTYPE).tolist()
            toks = split_token_rows(frame.output_ids, frame.output_counts)
            done = from_column(frame.completion_tokens, COUNT_DTYPE).tolist()
            for i, rid in enumerate(ids):
                stats = frame.request_stats[i] if frame.request_stats else None
                finish = frame.finished_reasons[i] if frame.finished_reasons else None
                rows.setdefault(rid, []).append(
                    Row(step, [int(t) for t in toks[i]], done[i], stats, finish)
                )
    return rows


def tokens(rows: list[Row]) -> list[int]:
    return [t for r in rows for t in r.tokens]


def assert_no_kv_leak(s: Scheduler) -> None:
    assert s.kv.num_used == s.cache.total_size, "a request's KV slots outlived it"
    assert s.cache.protected_size == 0 and not s.live


def assert_stats_exactly_when_changed(rows: list[Row]) -> None:
    """A row carries stats iff it is the first, the finished one, or a stats value changed
    since the last stats sent (docs/design.md section 3). In dLLM every committed block changes
    ``cached_tokens``, so every streamed row must carry stats, and never a stale value."""
    sent: RequestOutputStats | None = None
    for i, row in enumerate(rows):
        if row.stats is None:
            assert i > 0 and row.finish is None, f"row {i} should carry stats"
            continue
        assert i == 0 or row.finish is not None or row.stats != sent, (
            f"row {i} resent unchanged stats"
        )
        sent = row.stats


# --- in-process ------------------------------------------------------------------------


def test_block_positions_attend_to_each_other_both_ways() -> None:
    runner = make().runner
    prompt = PROMPTS[0]
    slots = runner.kv.alloc(len(prompt) + 2)
    assert slots is not None
    runner.extend([prompt[:-1]], [torch.empty(0, dtype=torch.long)], [slots[: len(prompt) - 1]])
    prefix, own = slots[: len(prompt) - 1], slots[len(prompt) - 1 :]

    def pass_logits(block: list[int], bidirectional: bool) -> torch.Tensor:
        start = len(prompt) if bidirectional else len(prompt) + 2
        return runner.logits_at([[prompt[-1], *block]], [prefix], [own], torch.arange(3), [start])

    a, b = pass_logits([0, 11], True), pass_logits([0, 22], True)
    assert torch.equal(a[0], b[0]), "the anchor is causal: it never sees the block"
    assert not torch.allclose(a[1], b[1]), "block position 0 sees position 1"
    c, d = pass_logits([0, 11], False), pass_logits([0, 22], False)
    assert torch.allclose(c[1], d[1]) and not torch.allclose(c[2], d[2])
    # logits_at agrees with forward's last-token logits.
    last, _ = runner.extend([[prompt[-1], 0, 11]], [prefix], [own])
    assert torch.allclose(c[2], last[0], atol=1e-5)


def test_rows_are_whole_blocks_and_cached_tokens_grow_per_block() -> None:
    s = make()
    prompt = PROMPTS[0]
    submit(s, 1, prompt, max_new=10)  # not a multiple of the block size
    submit(s, 2, PROMPTS[1], max_new=10, stream=False)
    rows = run(s)
    streamed = rows[1]
    assert [len(r.tokens) for r in streamed] == [4, 4, 2]
    assert [r.completion for r in streamed] == [4, 8, 10]
    # One prefill step, then S passes per block: a row every S steps.
    assert [r.step for r in streamed] == [1 + S, 1 + 2 * S, 1 + 3 * S]
    assert streamed[-1].finish == FinishLength(length=10) and all(
        r.finish is None for r in streamed[:-1]
    )
    # After each committed block the next block reuses the prompt's and every committed
    # block's KV; the last block has no successor, so the finished row repeats the value.
    cached = [r.stats.cached_tokens for r in streamed]  # type: ignore[union-attr]
    assert cached == [len(prompt) + 4, len(prompt) + 8, len(prompt) + 8]
    assert (
        streamed[1].stats.cached_tokens_details.device  # type: ignore[union-attr]
        == len(prompt) + 8
    )
    assert_stats_exactly_when_changed(streamed)
    # A non-streaming request: only its finished row, with every token.
    assert len(rows[2]) == 1 and len(rows[2][0].tokens) == 10 and rows[2][0].stats is not None
    assert s.generated_tokens_total == 20
    assert_no_kv_leak(s)


def test_one_token_blocks_in_one_step_decode_like_the_causal_model() -> None:
    """Block size 1, one pass: the anchor's logits pick each token, exactly as generate
    mode's decode does. Pins the anchor, the recompute of committed tokens and the mask."""
    for temperature in (0.0, 0.8):
        dllm = make(block=1, steps=1)
        plain = build_scheduler(ServerConfig(max_total_tokens=4096, torch_threads=1))
        for s in (dllm, plain):
            submit(s, 1, PROMPTS[0], max_new=10, temperature=temperature, seed=3)
        assert tokens(run(dllm)[1]) == tokens(run(plain)[1])


def test_greedy_is_reproducible_across_runs_and_batch_compositions() -> None:
    def alone() -> list[int]:
        s = make()
        submit(s, 1, PROMPTS[2], max_new=14)
        return tokens(run(s)[1])

    first = alone()
    assert len(first) == 14 and first == alone()
    # Batched with others that arrive later, so the batch mixes block starts (with the
    # committed tokens recomputed in front), mid-block passes and prefill chunks.
    s = make(chunk=16)
    submit(s, 1, PROMPTS[2], max_new=14)
    late = {
        2: lambda: submit(s, 2, PROMPTS[3], max_new=9),
        4: lambda: submit(s, 3, PROMPTS[4] * 2, max_new=20),
    }
    rows = run(s, at_step=late)
    assert tokens(rows[1]) == first
    others = tokens(rows[2])
    assert len(others) == 9 and others != first[:9], "different prompts should not decode alike"
    assert_no_kv_leak(s)


def test_seeded_sampling_is_reproducible() -> None:
    def sampled(seed: int, with_others: bool) -> list[int]:
        s = make()
        if with_others:
            submit(s, 9, PROMPTS[5], max_new=8, temperature=1.0, seed=99)
        submit(s, 1, PROMPTS[1], max_new=12, temperature=0.9, top_k=50, seed=seed)
        return tokens(run(s)[1])

    a = sampled(7, with_others=False)
    assert len(a) == 12
    assert sampled(7, with_others=True) == a
    assert sampled(8, with_others=False) != a


def test_stop_token_inside_a_block_truncates_the_row() -> None:
    s = make()
    submit(s, 1, PROMPTS[3], max_new=12)
    out = tokens(run(s)[1])
    # The first token that did not occur before it, and not the last of its block.
    k = next(i for i in range(1, len(out)) if out[i] not in out[:i] and i % B != B - 1)
    s = make()
    submit(s, 1, PROMPTS[3], max_new=12, stop_token_ids=(out[k],))
    rows = run(s)[1]
    assert tokens(rows) == out[: k + 1]
    assert rows[-1].finish == FinishStop(matched=out[k]) and rows[-1].completion == k + 1
    assert_no_kv_leak(s)


def test_stop_string_inside_a_block() -> None:
    tok = load_tokenizer(None)
    s = make()
    submit(s, 1, PROMPTS[4], max_new=12)
    out = tokens(run(s)[1])
    for k in range(1, len(out)):
        piece = tok.decode(out[k : k + 1]).strip()
        if len(piece) >= 2 and piece not in tok.decode(out[:k]):
            break
    else:
        pytest.skip("no distinctive token in this output")
    s = make()
    submit(s, 1, PROMPTS[4], max_new=12, stop=(piece,))
    rows = run(s)[1]
    assert tokens(rows) == out[: k + 1] and rows[-1].finish == FinishStop(matched=piece)


def test_committed_blocks_leave_causal_kv_like_a_prefill() -> None:
    """The pool holds for committed tokens exactly what a prefill computes: a prompt that
    continues a finished request (its blocks served from the prefix cache) decodes as it
    does on a cold scheduler."""
    s = make()
    submit(s, 1, PROMPTS[2], max_new=12)
    follow = PROMPTS[2] + tokens(run(s)[1]) + [77]
    submit(s, 2, follow, max_new=8)
    warm = run(s)[2]
    assert warm[0].stats.cached_tokens >= len(PROMPTS[2]) + 4  # type: ignore[union-attr]
    cold = make()
    submit(cold, 2, follow, max_new=8)
    assert tokens(warm) == tokens(run(cold)[2])


def test_retraction_restarts_the_block_and_leaks_nothing() -> None:
    """Greedy and seeded requests decode the same with or without retractions: a restarted
    block is recomputed from the same KV and redraws the same random numbers."""
    prompts = [[100 + i] * 16 + PROMPTS[0][:16] for i in range(8)]

    def run_all(s: Scheduler) -> dict[int, list[Row]]:
        # Staggered arrivals, so that blocks are at different passes when the pool runs short.
        def arrive(i: int) -> None:
            submit(s, i + 1, prompts[i], max_new=30, temperature=0.0 if i % 2 else 1.0, seed=i)

        return run(s, at_step={1 + i: (lambda i=i: arrive(i)) for i in range(len(prompts))})

    roomy = make(steps=3)
    expected = {rid: tokens(rows) for rid, rows in run_all(roomy).items()}
    assert roomy.num_retracted_total == 0

    s = make(pool=300, steps=3)
    mid_block = 0
    drop = s.mode.drop_block

    def counting_drop(req: Req) -> None:
        nonlocal mid_block
        mid_block += req.dllm_block is not None and not req.finished
        drop(req)

    s.mode.drop_block = counting_drop  # type: ignore[method-assign]
    rows = run_all(s)
    assert mid_block > 0, "some retraction should hit a block in progress"
    assert s.num_retracted_total > 0
    for rid, got in rows.items():
        assert len(tokens(got)) == 30 and tokens(got) == expected[rid], rid
        assert [len(r.tokens) for r in got] == [4] * 7 + [2]
        assert_stats_exactly_when_changed(got)
    retracted = [
        got
        for got in rows.values()
        if got[-1].stats.num_retractions  # type: ignore[union-attr]
    ]
    assert retracted
    assert_no_kv_leak(s)


def test_abort_mid_block_frees_its_kv() -> None:
    s = make()
    submit(s, 1, PROMPTS[1], max_new=12)
    run(s, until=2)  # prefill, then the first pass of the first block
    assert s.running and s.running[0].dllm_block is not None
    s.abort(AbortReq(req_id=1, reason="test"))
    rows = run(s)[1]
    assert isinstance(rows[-1].finish, FinishAbort) and rows[-1].stats is not None
    assert_no_kv_leak(s)


def test_admission_counts_the_whole_last_block() -> None:
    config = ServerConfig(mode="dllm", dllm_block_size=4, max_total_tokens=64)
    assert config.kv_tokens_needed(50, 13) == 66 > 64
    s = make(pool=64, block=4)
    submit(s, 1, PROMPTS[0][:10] * 5, max_new=13)  # 50 + 13 fits, 50 + 16 does not
    rows = run(s)[1]
    assert isinstance(rows[0].finish, FinishAbort) and rows[0].finish.status_code == 400
    with pytest.raises(ValueError, match="dllm-steps"):
        check_config(ServerConfig(mode="dllm", dllm_block_size=2, dllm_steps=3))


# --- end to end ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        Path(tmp_path_factory.mktemp("dllm-server")) / "tmp",
        ["--mode", "dllm", "--dllm-block-size", "4", "--dllm-steps", "2"],
    ).wait_ready()
    yield srv
    srv.stop()


def _stream(srv: ServerProcess, body: dict) -> list[dict]:  # type: ignore[type-arg]
    events = []
    with srv.client() as c, c.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                payload = line[len("data: ") :]
                if payload == "[DONE]":
                    break
                events.append(json.loads(payload))
    return events


def test_serve_streams_one_event_per_block(dllm_server: ServerProcess) -> None:
    n = 32
    body = {
        "text": "Once upon a time in a dLLM",
        "sampling_params": {"max_new_tokens": n, "temperature": 0.8, "seed": 5, "ignore_eos": True},
    }
    events = _stream(dllm_server, body)
    # One event per block, each holding the output so far. The API merges the rows of a
    # reader that falls behind (on a busy machine two blocks can reach it before it writes),
    # so allow whole multiples.
    ids = [e["output_ids"] for e in events]
    assert all(later[: len(earlier)] == earlier for earlier, later in zip(ids, ids[1:]))
    sizes = [len(later) - len(earlier) for earlier, later in zip([[], *ids], ids)]
    assert sum(sizes) == n and all(k > 0 and k % 4 == 0 for k in sizes), sizes
    assert len(events) > 2, sizes
    prompt = events[0]["meta_info"]["prompt_tokens"]
    cached = [e["meta_info"]["cached_tokens"] for e in events]
    # Prompt plus the blocks committed so far; the last block has no successor to reuse it.
    sent = [sum(sizes[: i + 1]) for i in range(len(sizes))]
    assert cached == [prompt + min(k, n - 4) for k in sent]
    assert cached[:-1] == sorted(set(cached[:-1])) and cached[-1] >= cached[-2]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": n}
    again = _stream(dllm_server, body)
    assert (
        again[-1]["text"] == events[-1]["text"]
        and again[-1]["output_ids"] == events[-1]["output_ids"]
    )
    with dllm_server.client() as c:
        whole = c.post("/generate", json=body).json()
    assert whole["output_ids"] == events[-1]["output_ids"]


def test_serve_logprobs_of_each_block_token(dllm_server: ServerProcess) -> None:
    """/generate return_logprob in --mode dllm: one entry per token of each block, equal to
    the reference loop's (tests/unit/test_dllm_logprobs.py: the pass that committed each token),
    prompt logprobs from the prefill, and each streamed event's entries those of its tokens
    so far, the last event's the whole answer's."""
    prompt = PROMPTS[1]
    sampling = {"max_new_tokens": 10, "temperature": 0.9, "seed": 5, "ignore_eos": True}
    body = {
        "input_ids": prompt,
        "sampling_params": sampling,
        "return_logprob": True,
        "top_logprobs_num": 3,
        "token_ids_logprob": [5, 77],
        "logprob_start_len": 0,
    }
    with dllm_server.client() as c:
        whole = c.post("/generate", json=body).json()
    meta, out = whole["meta_info"], whole["output_ids"]
    runner = make().runner  # the server's model (the default seed), block size and passes
    params = SamplingParams(**sampling)  # type: ignore[arg-type]
    expected, ref = reference_decode(runner, prompt, params, 5, S, max_new=10)
    assert out == expected
    assert [e[1] for e in meta["output_token_logprobs"]] == out
    for j, token in enumerate(out):
        assert meta["output_token_logprobs"][j][0] == pytest.approx(float(ref[j][token]), abs=1e-4)
        values, ids = ref[j].topk(3)
        assert [e[1] for e in meta["output_top_logprobs"][j]] == ids.tolist()
        assert [e[0] for e in meta["output_top_logprobs"][j]] == pytest.approx(
            values.tolist(), abs=1e-4
        )
        assert [e[0] for e in meta["output_token_ids_logprobs"][j]] == pytest.approx(
            [float(ref[j][t]) for t in (5, 77)], abs=1e-4
        )
    assert [e[1] for e in meta["input_token_logprobs"]] == prompt and meta["input_token_logprobs"][
        0
    ][0] is None
    events = _stream(dllm_server, body)
    keys = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")
    for e in events:
        for key in keys:
            assert len(e["meta_info"][key]) == len(e["output_ids"]), (
                "an event's entries are those of its tokens"
            )
        assert [entry[1] for entry in e["meta_info"]["input_token_logprobs"]] == prompt, (
            "the prompt's on every event"
        )
    for key in keys:
        # Per token: one [logprob, id, text] entry (chosen) or a list of them (top, ids).
        joined = _flat(events[-1]["meta_info"][key])
        alone = _flat(meta[key])
        assert [x[1:] for x in joined] == [x[1:] for x in alone], key
        # Equal up to float rounding: the two requests ran in different batches.
        assert [x[0] for x in joined] == pytest.approx([x[0] for x in alone], abs=1e-5), key


def _flat(per_token: list[list]) -> list[list]:  # type: ignore[type-arg]
    return [
        x
        for entry in per_token
        for x in (entry if entry and isinstance(entry[0], list) else [entry])
    ]
