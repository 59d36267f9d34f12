"""Rollout control where one service is several processes (docs/design/rollout.md, "PD and
several API workers"), on two tiny Llama checkpoints A and B written by transformers:

- ``--api-workers 2``: a pause, an update and a continue, each sent through one worker, are
  what every worker answers (/is_paused, /health, /get_weight_version, /model_info), and a
  greedy request through either worker then answers transformers' tokens of B, tagged with
  the new version;
- PD through sglang-router: both servers paused (retract; the decode server first) with a
  long stream in flight, held longer than a KV fetch may take, updated to B and continued;
  the stream ends with A's greedy tokens up to the pause and B's after it, and a fresh
  request through the pair answers B's tokens, tagged "step-1"; and paused that long without
  an update, the decode server continued first, a stream ends whole.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import torch

from bench import family_checkpoints
from tests.hf_checkpoints import TINY, require_transformers
from tests.server_harness import ServerProcess, free_port, wait_until
from tests.sglang_router import SglangRouter, router_binary

WORKERS = 2
# Room for a stream long enough to be in flight whatever the machine's speed.
SHAPE = dataclasses.replace(TINY, positions=2048)
PROMPT = [791, 406, 1419, 3993, 3530, 927, 279, 1605, 567]  # any ids of the 4096
NEW_TOKENS = 12
LONG_TOKENS = 1500
VERSION = "step-1"
# A greedy pick may differ from transformers' only where the two best logits are this close
# (float32 sums in another order): random weights make such near ties rare, never zero.
NEAR_TIE = 1e-3

T = TypeVar("T")


@dataclass(frozen=True)
class Checkpoints:
    a: Path
    b: Path
    hf_a: Any  # transformers' model of each, float32, eval mode
    hf_b: Any


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    require_transformers()
    a, b = tmp_path_factory.mktemp("checkpoint-a"), tmp_path_factory.mktemp("checkpoint-b")
    hf_a = family_checkpoints.write(a, "llama", shape=SHAPE, seed=0)
    hf_b = family_checkpoints.write(b, "llama", shape=SHAPE, seed=1)
    return Checkpoints(a, b, hf_a, hf_b)


def greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``prompt``: ``n`` tokens, EOS not stopping it."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None
        )
    continuation: list[int] = out[0, len(prompt) :].tolist()
    assert len(continuation) == n, "transformers stopped early"
    return continuation


def misses_greedy(hf: Any, context: list[int], start: int) -> list[int]:
    """The positions p >= ``start`` of ``context`` whose token is not ``hf``'s greedy pick
    after ``context[:p]`` (or one within ``NEAR_TIE`` of it): one forward, teacher-forced."""
    with torch.no_grad():
        logits = hf(torch.tensor([context])).logits[0].float()
    ids = torch.tensor(context[start:])
    chosen = logits[start - 1 : len(context) - 1].gather(1, ids[:, None])[:, 0]
    best = logits[start - 1 : len(context) - 1].max(dim=1).values
    return [start + int(i) for i in torch.nonzero(chosen < best - NEAR_TIE)[:, 0]]


def greedy_body(max_new: int, stream: bool = False) -> dict[str, Any]:
    params = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
    return {"input_ids": PROMPT, "stream": stream, "sampling_params": params}


def generated(client: httpx.Client) -> dict[str, Any]:
    r = client.post("/generate", json=greedy_body(NEW_TOKENS))
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


# --- several API workers ---------------------------------------------------------------


@pytest.fixture(scope="module")
def workers_server(
    checkpoints: Checkpoints, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        tmp_path_factory.mktemp("workers") / "tmp",
        ["--model-path", str(checkpoints.a), "--api-workers", str(WORKERS)],
    ).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.output()[-3000:]


def one_connection(srv: ServerProcess) -> httpx.Client:
    return httpx.Client(base_url=srv.url, timeout=120, limits=httpx.Limits(max_connections=1))


def worker_of(client: httpx.Client) -> int:
    """The API worker behind the client's (one) connection."""
    return int(client.get("/server_info").json()["api_worker_index"])


@contextmanager
def client_of(srv: ServerProcess, worker: int) -> Iterator[httpx.Client]:
    """A client whose connection reached ``worker`` (the kernel picks a worker for each new
    connection: new ones until it is that one)."""
    for _ in range(200):
        with one_connection(srv) as client:
            if worker_of(client) == worker:
                yield client
                return
    pytest.fail(f"200 connections never reached API worker {worker}")


def on_each_worker(srv: ServerProcess, ask: Callable[[httpx.Client], T]) -> dict[int, T]:
    """``ask``'s answer from every API worker: fresh connections until each worker answered,
    the worker read before and after ``ask`` on the same connection."""
    answers: dict[int, T] = {}
    for _ in range(200):
        with one_connection(srv) as client:
            before = worker_of(client)
            answer = ask(client)
            if worker_of(client) == before:
                answers.setdefault(before, answer)
        if len(answers) == WORKERS:
            return answers
    pytest.fail(f"200 connections reached only the API workers {sorted(answers)}")


def generated_through(srv: ServerProcess, worker: int) -> dict[str, Any]:
    with client_of(srv, worker) as client:
        return generated(client)


def queued(client: httpx.Client) -> int:
    """The requests waiting in the scheduler, as its latest report says."""
    return int(client.get("/server_info").json()["scheduler"]["num_queue_reqs"])


def state_of(client: httpx.Client) -> dict[str, Any]:
    """What a worker says of the rollout state, on every route that says it."""
    health = client.get("/health")
    return {
        "is_paused": client.get("/is_paused").json()["is_paused"],
        "health": (health.status_code, health.json() if health.content else None),
        "weight_version": client.get("/get_weight_version").json()["weight_version"],
        "model_info": client.get("/model_info").json()["weight_version"],
    }


def every_worker_answers(srv: ServerProcess, expected: dict[str, Any]) -> None:
    answers = on_each_worker(srv, state_of)
    assert answers == dict.fromkeys(range(WORKERS), expected)


def test_pause_update_and_continue_through_one_worker_reach_every_worker(
    workers_server: ServerProcess, checkpoints: Checkpoints
) -> None:
    srv = workers_server
    want_a = greedy(checkpoints.hf_a, PROMPT, NEW_TOKENS)
    want_b = greedy(checkpoints.hf_b, PROMPT, NEW_TOKENS)
    assert want_a != want_b, "the two checkpoints answer alike: the test would prove nothing"
    for answer in on_each_worker(srv, generated).values():
        assert answer["output_ids"] == want_a
        assert answer["meta_info"]["weight_version"] == "default"

    with client_of(srv, 0) as first, client_of(srv, 1) as second:
        r = first.post("/pause_generation", json={"mode": "retract"})
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
        paused = {"is_paused": True, "health": (200, {"status": "paused", "mode": "retract"})}
        every_worker_answers(srv, {**paused, "weight_version": "default", "model_info": "default"})

        # A request through the other worker waits out the pause, and the update, in the queue.
        held: dict[str, Any] = {}
        waiting = threading.Thread(target=lambda: held.update(generated_through(srv, 1)))
        waiting.start()
        assert wait_until(lambda: queued(second) == 1, 30, interval=0.1), "it never arrived"
        r = second.post(
            "/update_weights_from_disk",
            json={"model_path": str(checkpoints.b), "weight_version": VERSION},
        )
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        # An update never ends a pause.
        every_worker_answers(srv, {**paused, "weight_version": VERSION, "model_info": VERSION})

        r = first.post("/resume")  # vLLM's spelling, through the worker that paused
        assert r.status_code == 200 and r.json() == {"status": "resumed"}, r.text
        waiting.join(timeout=120)
        assert not waiting.is_alive(), "the request held by the pause never finished"

    every_worker_answers(
        srv,
        {
            "is_paused": False,
            "health": (200, None),
            "weight_version": VERSION,
            "model_info": VERSION,
        },
    )
    for answer in [held, *on_each_worker(srv, generated).values()]:
        assert answer["output_ids"] == want_b
        assert answer["meta_info"]["weight_version"] == VERSION


# --- PD: a prefill server and a decode server behind sglang-router ------------------------


FETCH_TIMEOUT = 6  # seconds: --disaggregation-bootstrap-timeout of the decode server


@dataclass(frozen=True)
class PdPair:
    prefill: ServerProcess
    decode: ServerProcess
    router: SglangRouter


@pytest.fixture(scope="module")
def pd_pair(checkpoints: Checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdPair]:
    router_binary()  # skip (or fail in CI) before starting anything
    base = tmp_path_factory.mktemp("pd-rollout")
    bootstrap_port = free_port()
    model = ["--model-path", str(checkpoints.a)]
    prefill = ServerProcess(
        base / "prefill",
        [*model, "--disaggregation-mode", "prefill"]
        + ["--disaggregation-bootstrap-port", str(bootstrap_port)],
    )
    # A fetch's deadline shorter than the test's pause: a fetch that began at the retraction,
    # not at the continue, would time out (504) while paused.
    timeout = ["--disaggregation-bootstrap-timeout", str(FETCH_TIMEOUT)]
    decode = ServerProcess(base / "decode", [*model, "--disaggregation-mode", "decode", *timeout])
    router: SglangRouter | None = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        args = ["--pd-disaggregation", "--prefill", prefill.url, str(bootstrap_port)]
        args += ["--decode", decode.url, "--disable-retries"]
        router = SglangRouter(args, base / "router.log").wait_ready(workers=2)
        yield PdPair(prefill, decode, router)
    finally:
        if router is not None:
            router.stop()
        prefill.stop()
        decode.stop()


class StreamReader(threading.Thread):
    """Reads one /generate stream through ``url``; ``started`` is set at its first event."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.started = threading.Event()
        self.events: list[dict[str, Any]] = []
        self.error: str | None = None

    def run(self) -> None:
        try:
            with (
                httpx.Client(base_url=self.url, timeout=300, trust_env=False) as client,
                client.stream("POST", "/generate", json=self.body) as response,
            ):
                if response.status_code != 200:
                    self.error = f"{response.status_code}: {response.read()!r}"
                    return
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        self.events.append(json.loads(line.removeprefix("data: ")))
                        self.started.set()
        except httpx.HTTPError as exc:
            self.error = repr(exc)
        finally:
            self.started.set()


def control(srv: ServerProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(srv.url + path, json=body, timeout=120)
    assert r.status_code == 200, (path, r.text)
    answer: dict[str, Any] = r.json()
    return answer


def test_pd_pair_paused_updated_and_continued_mid_stream_serves_the_new_weights(
    pd_pair: PdPair, checkpoints: Checkpoints
) -> None:
    prefill, decode, router = pd_pair.prefill, pd_pair.decode, pd_pair.router
    stream = StreamReader(router.url, greedy_body(LONG_TOKENS, stream=True))
    stream.start()
    assert stream.started.wait(120) and stream.error is None, stream.error

    # The decode server first, while the prefill server still runs A: a paused decode server
    # asks for the retracted request's KV only once it runs again, so the prefill server
    # (given time to answer a fetch sent at once) computes it with B after all.
    held = control(decode, "/pause_generation", {"mode": "retract"})
    assert held["num_paused_requests"] == 1, "the stream ended before the pause"
    time.sleep(0.5)
    control(prefill, "/pause_generation", {"mode": "retract"})
    for srv in (prefill, decode):
        assert httpx.get(srv.url + "/is_paused").json() == {"is_paused": True}
        update = {"model_path": str(checkpoints.b), "weight_version": VERSION}
        assert control(srv, "/update_weights_from_disk", update)["success"] is True
        assert httpx.get(srv.url + "/get_weight_version").json() == {"weight_version": VERSION}
    time.sleep(FETCH_TIMEOUT + 1)  # paused longer than a KV fetch may take
    control(prefill, "/continue_generation", {})
    control(decode, "/continue_generation", {})

    stream.join(timeout=300)
    assert not stream.is_alive() and stream.error is None, stream.error
    assert_stream_switched_weights(stream.events, checkpoints)
    assert decode.output().count("re-bootstrapping its KV") == 1, decode.output()[-3000:]

    with router.client() as client:
        fresh = generated(client)
    assert fresh["output_ids"] == greedy(checkpoints.hf_b, PROMPT, NEW_TOKENS)
    assert fresh["meta_info"]["weight_version"] == VERSION
    for srv in (prefill, decode):
        assert httpx.get(srv.url + "/is_paused").json() == {"is_paused": False}


def assert_stream_switched_weights(events: list[dict[str, Any]], ckpt: Checkpoints) -> None:
    """The stream's tokens are A's greedy ones up to some k and B's greedy continuation of
    the prompt and those k tokens after it; its events tagged "default" end at or before k,
    those tagged with the new version end after it."""
    final = events[-1]
    out, meta = final["output_ids"], final["meta_info"]
    assert len(out) == LONG_TOKENS and meta["finish_reason"]["type"] == "length", meta
    assert meta["num_retractions"] == 1 and meta["weight_version"] == VERSION, meta
    versions = [e["meta_info"]["weight_version"] for e in events]
    switch = versions.index(VERSION)
    assert set(versions[:switch]) == {"default"} and set(versions[switch:]) == {VERSION}, versions
    assert switch > 0, "no event came before the pause"
    lo, hi = len(events[switch - 1]["output_ids"]), len(events[switch]["output_ids"]) - 1
    context = PROMPT + out
    a_misses = misses_greedy(ckpt.hf_a, context, len(PROMPT))
    b_misses = misses_greedy(ckpt.hf_b, context, len(PROMPT))
    fits = [
        k
        for k in range(lo, hi + 1)
        if all(p >= len(PROMPT) + k for p in a_misses)
        and all(p < len(PROMPT) + k for p in b_misses)
    ]
    assert fits, (lo, hi, a_misses[:5], b_misses[:5])
    print(f"\nPD stream: A's tokens up to {fits[0]}, then B's, of {LONG_TOKENS}")


def test_pd_pair_paused_longer_than_a_kv_fetch_may_take_loses_nothing(pd_pair: PdPair) -> None:
    """Both servers paused (retract) with a stream in flight, the prefill server first, for
    longer than the decode server's fetch timeout, no update, and the decode server continued
    first: it asks for the retracted request's KV only once it runs again (a fetch begun at
    the retraction would have timed out with a 504 at its first step), the prefill server
    answers once it continues, and the stream ends whole."""
    prefill, decode, router = pd_pair.prefill, pd_pair.decode, pd_pair.router
    stream = StreamReader(router.url, greedy_body(LONG_TOKENS, stream=True))
    stream.start()
    assert stream.started.wait(120) and stream.error is None, stream.error
    control(prefill, "/pause_generation", {"mode": "retract"})
    held = control(decode, "/pause_generation", {"mode": "retract"})
    assert held["num_paused_requests"] == 1, "the stream ended before the pause"
    time.sleep(FETCH_TIMEOUT + 1)
    control(decode, "/continue_generation", {})
    control(prefill, "/continue_generation", {})
    stream.join(timeout=300)
    assert not stream.is_alive() and stream.error is None, stream.error
    last = stream.events[-1]["meta_info"]
    assert last["finish_reason"]["type"] == "length", last["finish_reason"]
    assert last["num_retractions"] == 1
