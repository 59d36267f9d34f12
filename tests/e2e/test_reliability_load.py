"""Reliability under load, end to end against one real server (issue items 1, 2 and 6):

- 200 concurrent streaming clients: no errors, no tokens lost, every stream's token count
  equals its final completion_tokens (bench/load.py's core, at a smaller size);
- 100 streams cut at random points (FIN or RST), plus non-streaming requests given up by
  a client timeout: every one is aborted in the scheduler, and no request, KV slot or
  decode state is left in any process;
- bench/memory.py's smoke run: a few hundred short requests leave no per-request state.
  (Not the RSS growth target: a sample this small says nothing about it.)
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import uvloop

from tests.server_harness import ServerProcess

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _import(name: str, path: Path) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


load = _import("tokenpipe_bench_load", BENCH / "load.py")  # the name bench/memory.py imports it by
memory = _import("tokenpipe_bench_memory", BENCH / "memory.py")


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server of this module's own: the checks read its global counters and need it idle.
    Default --max-running-requests (256), so all 200 streams run in one batch. Its /generate
    events carry only what is new (--incremental-streaming-output): bench/load.py counts the
    tokens each stream received by summing the events' output_ids."""
    load.raise_open_files_limit(2048)  # the server inherits it
    server = ServerProcess(
        tmp_path_factory.mktemp("reliability") / "tmp", ["--incremental-streaming-output"]
    ).wait_ready()
    yield server
    server.stop()


def wait_drained(url: str, min_steps: int, timeout: float = 30.0) -> dict[str, Any]:
    """/server_info once no request is live in the API and the scheduler's latest report,
    sent after ``min_steps`` forward steps, says it holds none either."""
    info = uvloop.run(memory.wait_idle(url, timeout=timeout, min_steps=min_steps))
    return info


def test_200_concurrent_streams_lose_nothing(srv: ServerProcess) -> None:
    n, max_new = 200, 32
    summary = uvloop.run(load.run_load(srv.url, n, max_new_tokens=max_new, timeout=120.0))
    results = summary["results"]
    assert summary["errors"] == 0, summary["error_examples"]
    assert summary["tokens_lost"] == 0
    assert len(results) == n
    for r in results:
        assert r.done and r.tokens == r.completion_tokens == max_new, r
        assert r.finish_reason == {"type": "length", "length": max_new}, r
    # All 200 were open at once (every stream runs 32 decode steps of a ~200-row batch,
    # far longer than opening the connections takes).
    assert summary["held"] >= n * 0.9, summary["held"]
    assert summary["tokens"] == n * max_new


async def _cut_requests(
    url: str, n_streams: int, n_timeouts: int, seed: int
) -> tuple[list[Any], list[bool]]:
    """``n_streams`` streams, each closed after a random number of events (0 to 12; odd
    ones with an RST), and ``n_timeouts`` non-streaming requests given up after a random
    0.3-1.5 s. Returns the stream results and, per non-streaming request, whether it was
    cut before its answer."""
    rng = random.Random(seed)
    vocab = (await load.get_json(url, "/server_info"))["vocab_size"]

    def body(i: int, stream: bool) -> dict:
        return load.make_body(
            i, vocab=vocab, prompt_len=16, max_new_tokens=1500, seed=seed, stream=stream
        )

    cuts = [rng.randint(0, 12) for _ in range(n_streams)]
    waits = [rng.uniform(0.3, 1.5) for _ in range(n_timeouts)]

    async def give_up(i: int) -> bool:
        conn = load.Connection.for_url(url)
        try:
            resp = await asyncio.wait_for(
                conn.request("POST", "/generate", body(n_streams + i, False)), waits[i]
            )
            await resp.read()
            return False  # answered: not cut
        except TimeoutError:
            return True
        finally:
            conn.close()

    streams = [
        load.stream_one(url, i, body(i, True), cut_after=cuts[i], reset=bool(i % 2))
        for i in range(n_streams)
    ]
    out = await asyncio.gather(*streams, *(give_up(i) for i in range(n_timeouts)))
    return list(out[:n_streams]), list(out[n_streams:])


def test_client_disconnects_abort_everything(srv: ServerProcess) -> None:
    # The previous test's last answers reach the client before the scheduler's idle report
    # (sent after that step's frames) reaches the API: wait for the report, not only the answers.
    before = wait_drained(srv.url, min_steps=0)
    sched_before = before["scheduler"]
    assert before["live_requests"] == 0 and sched_before["live_reqs"] == 0, before
    assert sched_before["token_usage"] == 0.0, sched_before

    streams, timed_out = uvloop.run(_cut_requests(srv.url, n_streams=100, n_timeouts=10, seed=7))

    for r in streams:
        assert r.error is None and r.status == 200, r
        assert r.cut and r.finish_reason is None and not r.done, (
            r
        )  # 1500 tokens: none can finish first
        assert r.tokens == r.completion_tokens or r.events == 0, r
    assert all(timed_out), timed_out
    expected_aborts = sum(r.finish_reason is None for r in streams) + sum(timed_out)

    after = wait_drained(srv.url, min_steps=sched_before["forward_steps_total"] + 1)
    sched = after["scheduler"]
    assert after["live_requests"] == 0, after["live_requests"]
    assert sched["live_reqs"] == 0, sched
    assert sched["num_running_reqs"] == 0 and sched["num_queue_reqs"] == 0, sched
    assert after["aborted_requests"] - before["aborted_requests"] == expected_aborts == 110
    assert sched["token_usage"] == sched_before["token_usage"] == 0.0, sched
    assert sched["detokenizer_live_reqs"] == 0, sched
    # The KV the cut requests computed is held only by the evictable prefix cache now.
    assert sched["kv_used_tokens"] == sched["cached_tokens_in_tree"], sched

    # And the server still serves.
    ok = uvloop.run(
        load.stream_one(
            srv.url,
            0,
            {
                "text": "after the storm",
                "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
                "stream": True,
            },
        )
    )
    assert ok.error is None and ok.tokens == ok.completion_tokens == 4, ok


def test_memory_bench_smoke_leaves_no_state(srv: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    t0 = time.monotonic()
    memory.main(
        ["--url", srv.url, "--supervisor-pid", str(srv.proc.pid), "--requests", "300", "--warmup",
            "100",
         "--concurrency", "32", "--no-progress", "--json", str(out)]
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["errors"] == 0, result["error_examples"]
    assert result["requests_done"] == 300
    assert result["no_state_left"], result["state_left"]
    assert result["state_left"] == {
        "live_requests": 0,
        "scheduler_live_reqs": 0,
        "detokenizer_live_reqs": 0,
        "token_usage": 0.0,
    }
    for role in memory.ROLES:
        assert result["rss_kib_warmup"][role] > 0 and result["rss_kib_end"][role] > 0, role
    assert time.monotonic() - t0 < 120
