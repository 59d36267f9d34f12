"""Rollout control as an RL loop drives it (docs/design/rollout.md): two checkpoints A and B
written by transformers, one server started on A and updated at run time, and a server
started on B as the reference for what B's weights answer.

Requests go in as token ids and decode greedily (or seeded) under
``--enable-deterministic-inference`` and one torch thread, so every answer has one right
value, to the bit, whatever it was batched with: the reference servers' tokens and
logprobs. Events stream one token each (``stream_interval`` 1), so each event's
``weight_version`` names the weights that made its token."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors.torch import load_file, save_file

from bench import family_checkpoints
from tests.hf_checkpoints import TINY, require_transformers
from tests.prometheus_server import running_prometheus, scalar
from tests.server_harness import ServerProcess, descendants, wait_until

QUEUE_LIMIT = 80
LONG = 200  # tokens of a stream that a pause catches halfway
EXACT = ["--enable-deterministic-inference", "--torch-threads", "1"]
PROMPTS = [[11 + 7 * i, 300 + i, 42, 1000 + 13 * i, 7] for i in range(8)]


@dataclass
class Servers:
    main: ServerProcess  # started on A; every test leaves it running A as version "a"
    ref_b: ServerProcess
    a: Path
    b: Path
    root: Path
    ref_a: dict[int, dict[str, Any]] = field(default_factory=dict)  # prompt index -> answer


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    require_transformers()
    root = tmp_path_factory.mktemp("rollout")
    a, b = root / "A", root / "B"
    family_checkpoints.write(a, "llama", shape=TINY, seed=0)
    family_checkpoints.write(b, "llama", shape=TINY, seed=1)
    main_args = ["--model-path", str(a), "--weight-version", "a", *EXACT]
    main_args += ["--incremental-streaming-output"]  # each event: its own tokens
    main = ServerProcess(root / "main", [*main_args, "--max-queued-requests", str(QUEUE_LIMIT)])
    ref_b = ServerProcess(root / "ref_b", ["--model-path", str(b), *EXACT])
    with main.wait_ready(), ref_b.wait_ready():
        found = Servers(main, ref_b, a, b, root)
        found.ref_a = {i: greedy(main, i, LONG) for i in range(len(PROMPTS))}
        yield found


def greedy(srv: ServerProcess, i: int, max_new_tokens: int = 16) -> dict[str, Any]:
    body = {
        "input_ids": PROMPTS[i],
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    with srv.client() as client:
        answer = client.post("/generate", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def control(srv: ServerProcess, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    with srv.client() as client:
        return client.post(path, json=body if body is not None else {})


def update(srv: ServerProcess, path: Path, version: str, **extra: Any) -> httpx.Response:
    return control(
        srv,
        "/update_weights_from_disk",
        {"model_path": str(path), "weight_version": version, **extra},
    )


def restore_a(servers: Servers) -> None:
    """Back to A, version "a", running."""
    control(servers.main, "/continue_generation")
    assert update(servers.main, servers.a, "a").status_code == 200


@dataclass
class Stream:
    tokens: list[int] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)  # one per token
    meta: dict[str, Any] = field(default_factory=dict)


async def stream(
    client: httpx.AsyncClient, input_ids: list[int], sampling: dict[str, Any], out: Stream
) -> None:
    body = {"input_ids": input_ids, "stream": True, "sampling_params": sampling}
    async with client.stream("POST", "/generate", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            out.tokens.extend(event["output_ids"])
            out.versions.extend([event["meta_info"]["weight_version"]] * len(event["output_ids"]))
            out.meta = event["meta_info"]


def long_sampling(max_new_tokens: int = LONG, **extra: Any) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True, **extra}


async def wait_for_tokens(streams: list[Stream], at_least: int = 2) -> None:
    while not all(len(s.tokens) >= at_least for s in streams):
        await asyncio.sleep(0.01)


def test_retract_update_continue_serves_b_exactly(servers: Servers) -> None:
    """The issue's loop: 8 long streams on A; pause (retract) stops them; the update to B
    answers success; continue; every stream finishes, retracted once, its tokens A's before
    the swap and B's continuation of them after; a fresh request equals the server started
    on B, logprobs within 1e-5, with the new version."""
    main = servers.main

    async def run() -> list[Stream]:
        outs = [Stream() for _ in PROMPTS]
        async with httpx.AsyncClient(base_url=main.url, timeout=120) as client:
            tasks = [
                asyncio.create_task(stream(client, p, long_sampling(), o))
                for p, o in zip(PROMPTS, outs, strict=True)
            ]
            await wait_for_tokens(outs)
            paused = (await client.post("/pause_generation", json={"mode": "retract"})).json()
            assert paused == {
                "message": "Generation paused successfully.",
                "status": "ok",
                "num_paused_requests": len(PROMPTS),
            }
            held = [len(o.tokens) for o in outs]
            assert (await client.get("/is_paused")).json() == {"is_paused": True}
            health = await client.get("/health")
            assert health.status_code == 200
            assert health.json() == {"status": "paused", "mode": "retract"}
            assert (await client.get("/health_generate")).status_code == 200
            body = {"model_path": str(servers.b), "weight_version": "step-1"}
            answer = await client.post("/update_weights_from_disk", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["success"] is True
            assert answer.json()["num_paused_requests"] == len(PROMPTS)
            await asyncio.sleep(0.5)
            # Nothing moved while paused: the pause came between two steps.
            assert [len(o.tokens) for o in outs] == held
            assert (await client.post("/continue_generation", json={})).status_code == 200
            await asyncio.gather(*tasks)
        return outs

    outs = asyncio.run(run())
    with main.client() as client:
        assert client.get("/get_weight_version").json() == {"weight_version": "step-1"}
        assert client.get("/model_info").json()["weight_version"] == "step-1"
        assert client.get("/is_paused").json() == {"is_paused": False}
    tails = asyncio.run(continuations(servers.ref_b, outs))
    for i, (out, tail) in enumerate(zip(outs, tails, strict=True)):
        assert len(out.tokens) == LONG and out.meta["finish_reason"]["type"] == "length"
        assert out.meta["num_retractions"] == 1 and out.meta["weight_version"] == "step-1"
        before = out.versions.count("a")
        assert out.versions == ["a"] * before + ["step-1"] * (LONG - before), out.versions
        assert 2 <= before < LONG
        # A's tokens before the swap; B's greedy continuation of them after.
        assert out.tokens[:before] == servers.ref_a[i]["output_ids"][:before]
        assert out.tokens[before:] == tail
    fresh, reference = greedy(main, 3), greedy(servers.ref_b, 3)
    assert fresh["output_ids"] == reference["output_ids"]
    assert fresh["meta_info"]["weight_version"] == "step-1"
    got = fresh["meta_info"]["output_token_logprobs"]
    want = reference["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in got] == [t for _, t, _ in want]
    assert max(abs(g[0] - w[0]) for g, w in zip(got, want, strict=True)) <= 1e-5
    restore_a(servers)


async def continuations(srv: ServerProcess, outs: list[Stream]) -> list[list[int]]:
    """What ``srv``'s weights decode greedily after each stream's prompt and the tokens it
    had before the swap, to ``LONG`` tokens in all."""

    async def one(client: httpx.AsyncClient, prompt: list[int], out: Stream) -> list[int]:
        prefix = out.tokens[: out.versions.count("a")]
        body = {"input_ids": prompt + prefix, "sampling_params": long_sampling(LONG - len(prefix))}
        return list((await client.post("/generate", json=body)).json()["output_ids"])

    async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
        return list(await asyncio.gather(*(one(client, p, o) for p, o in zip(PROMPTS, outs))))


def sampled(i: int, max_new_tokens: int = LONG) -> dict[str, Any]:
    return {
        "max_new_tokens": max_new_tokens,
        "temperature": 0.9,
        "seed": 100 + i,
        "ignore_eos": True,
    }


async def seeded_streams(
    srv: ServerProcess, pause_mode: str | None
) -> tuple[list[Stream], dict[str, Any] | None]:
    """One seeded sampled stream per prompt; with ``pause_mode``, paused once they all have
    tokens, held a moment, and continued. Returns the streams and the pause's answer."""
    outs = [Stream() for _ in PROMPTS]
    answer = None
    async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
        tasks = [
            asyncio.create_task(stream(client, p, sampled(i), o))
            for i, (p, o) in enumerate(zip(PROMPTS, outs, strict=True))
        ]
        if pause_mode is not None:
            await wait_for_tokens(outs)
            paused = await client.post("/pause_generation", json={"mode": pause_mode})
            answer = paused.json()
            await asyncio.sleep(0.3)
            assert (await client.post("/continue_generation")).status_code == 200
        await asyncio.gather(*tasks)
    return outs, answer


def test_in_place_and_retract_resume_seeded_streams_unchanged(servers: Servers) -> None:
    """A pause in place changes nothing; one that retracts changes nothing either but the
    retraction count: seeded sampled streams equal their uninterrupted run token for token."""
    uninterrupted, _ = asyncio.run(seeded_streams(servers.main, None))
    for mode, retractions in (("in_place", 0), ("retract", 1)):
        outs, answer = asyncio.run(seeded_streams(servers.main, mode))
        assert answer is not None and answer["status"] == "ok", answer
        for out, reference in zip(outs, uninterrupted, strict=True):
            assert out.tokens == reference.tokens, mode
            assert out.meta["num_retractions"] == retractions
            assert set(out.versions) == {"a"}


def test_abort_mode_ends_every_request_with_its_output_so_far(servers: Servers) -> None:
    """Streams and a whole-answer request in flight end with an abort finish and the tokens
    they had; requests after the continue are served as before."""

    async def run() -> tuple[list[Stream], httpx.Response]:
        outs = [Stream() for _ in range(4)]
        async with httpx.AsyncClient(base_url=servers.main.url, timeout=120) as client:
            tasks = [
                asyncio.create_task(stream(client, PROMPTS[i], long_sampling(), o))
                for i, o in enumerate(outs)
            ]
            body = {"input_ids": PROMPTS[5], "sampling_params": long_sampling()}
            whole = asyncio.create_task(client.post("/generate", json=body))
            await wait_for_tokens(outs)
            paused = await client.post("/pause_generation", json={"mode": "abort"})
            assert paused.json()["status"] == "ok"
            await asyncio.gather(*tasks)
            answer = await whole
            assert (await client.post("/continue_generation")).status_code == 200
        return outs, answer

    outs, whole = asyncio.run(run())
    for i, out in enumerate(outs):
        assert out.meta["finish_reason"]["type"] == "abort", out.meta
        assert 0 < len(out.tokens) < LONG
        assert out.tokens == servers.ref_a[i]["output_ids"][: len(out.tokens)]
    assert whole.status_code == 200, whole.text
    meta = whole.json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < LONG
    assert greedy(servers.main, 1)["output_ids"] == servers.ref_a[1]["output_ids"][:16]


def broken_copies(servers: Servers) -> dict[str, tuple[Path, str]]:
    """Checkpoints the update must refuse, each with what its message must name."""
    misshapen = servers.root / "misshapen"
    shutil.copytree(servers.b, misshapen)
    tensors = load_file(misshapen / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, misshapen / "model.safetensors", metadata={"format": "pt"})
    other_config = servers.root / "other_config"
    shutil.copytree(servers.b, other_config)
    config = json.loads((other_config / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (other_config / "config.json").write_text(json.dumps(config))
    return {
        "misshapen": (misshapen, name),
        "other config": (other_config, "rms_norm_eps: 0.001 (served: 1e-06)"),
        "missing": (servers.root / "nowhere", "is not a directory"),
    }


def test_a_checkpoint_that_does_not_fit_changes_nothing(servers: Servers) -> None:
    """A wrong shape, another config or no checkpoint: 400 naming why, and A serves on as
    version "a", bit for bit."""
    for case, (path, named) in broken_copies(servers).items():
        answer = update(servers.main, path, "never")
        assert answer.status_code == 400, case
        body = answer.json()
        assert body["success"] is False and named in body["message"], (case, body)
        assert "unchanged" in body["message"]
    bad_format = update(servers.main, servers.b, "never", load_format="pt")
    assert bad_format.status_code == 400 and "load_format" in bad_format.text
    with servers.main.client() as client:
        assert client.get("/get_weight_version").json() == {"weight_version": "a"}
    again = greedy(servers.main, 2, LONG)
    assert again["output_ids"] == servers.ref_a[2]["output_ids"]
    assert (
        again["meta_info"]["output_token_logprobs"]
        == (servers.ref_a[2]["meta_info"]["output_token_logprobs"])
    )
    assert again["meta_info"]["weight_version"] == "a"


def test_paused_requests_wait_within_the_queue_limit(servers: Servers) -> None:
    """Paused, arrivals wait (their clients kept waiting, /health 200); one beyond
    --max-queued-requests gets 503 with Retry-After; after the continue every waiting one
    is served, with A's tokens."""

    async def run() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=servers.main.url, timeout=120) as client:
            assert (await client.post("/pause_generation", json={"mode": "retract"})).is_success
            body = {"input_ids": PROMPTS[0], "sampling_params": long_sampling(4)}
            waiting = [
                asyncio.create_task(client.post("/generate", json=body)) for _ in range(QUEUE_LIMIT)
            ]
            while (await client.get("/get_load")).json()[0]["num_reqs"] < QUEUE_LIMIT:
                await asyncio.sleep(0.02)
            beyond = await client.post("/generate", json=body)
            assert (await client.get("/health")).status_code == 200
            assert not any(task.done() for task in waiting)
            assert (await client.post("/continue_generation")).is_success
            return list(await asyncio.gather(*waiting)), beyond

    served, beyond = asyncio.run(run())
    assert beyond.status_code == 503 and "Retry-After" in beyond.headers, beyond.text
    assert all(r.status_code == 200 for r in served)
    assert {tuple(r.json()["output_ids"]) for r in served} == {
        tuple(servers.ref_a[0]["output_ids"][:4])
    }


def test_vllm_spellings(servers: Servers) -> None:
    """vLLM's /pause?mode=wait answers once the running request ended (and admits none
    meanwhile), /is_paused says so, /resume runs again; keep is in place; an unknown mode is
    a 400 naming the modes."""

    async def run() -> None:
        async with httpx.AsyncClient(base_url=servers.main.url, timeout=120) as client:
            out = Stream()
            running = asyncio.create_task(stream(client, PROMPTS[4], long_sampling(), out))
            await wait_for_tokens([out])
            paused = await client.post("/pause", params={"mode": "wait"})
            assert paused.json() == {"status": "paused"}
            assert running.done() and len(out.tokens) == LONG
            assert out.tokens == servers.ref_a[4]["output_ids"]
            assert (await client.get("/is_paused")).json() == {"is_paused": True}
            assert (await client.post("/resume")).json() == {"status": "resumed"}
            assert (await client.get("/is_paused")).json() == {"is_paused": False}
            kept = await client.post("/pause", params={"mode": "keep"})
            assert kept.json() == {"status": "paused"}
            assert (await client.get("/health")).json() == {"status": "paused", "mode": "in_place"}
            assert (await client.post("/resume")).is_success
            bad = await client.post("/pause", params={"mode": "sleep"})
            assert bad.status_code == 400 and "keep" in bad.json()["error"]["message"]

    asyncio.run(run())


def test_sglang_control_bodies_as_its_clients_send_them(servers: Servers) -> None:
    """SGLang's control bodies: its BaseReq ``rid`` and continue's ``torch_empty_cache`` are
    taken; an unknown mode or field is a 400 naming it, and changes nothing."""
    main = servers.main
    paused = control(main, "/pause_generation", {"mode": "in_place", "rid": "ctl-1"})
    assert paused.status_code == 200 and paused.json()["status"] == "ok"
    resumed = control(main, "/continue_generation", {"torch_empty_cache": False, "rid": ["c"]})
    assert resumed.status_code == 200
    for body, named in (({"mode": "sleep"}, "mode"), ({"mode": "abort", "bogus": 1}, "bogus")):
        refused = control(main, "/pause_generation", body)
        assert refused.status_code == 400 and named in refused.text, refused.text
    with main.client() as client:
        assert client.get("/is_paused").json() == {"is_paused": False}


def test_update_while_running_waits_for_the_running_requests_or_aborts_them(
    servers: Servers,
) -> None:
    """Not paused, an update swaps once the running stream ended, every one of its tokens
    A's; with abort_all_requests the stream ends at once with an abort finish instead."""

    async def run(abort_all: bool) -> tuple[Stream, httpx.Response]:
        async with httpx.AsyncClient(base_url=servers.main.url, timeout=120) as client:
            out = Stream()
            running = asyncio.create_task(stream(client, PROMPTS[6], long_sampling(), out))
            await wait_for_tokens([out])
            body = {
                "model_path": str(servers.b),
                "weight_version": "b",
                "abort_all_requests": abort_all,
            }
            answer = await client.post("/update_weights_from_disk", json=body)
            await running
            return out, answer

    out, answer = asyncio.run(run(abort_all=False))
    assert answer.json()["success"] is True
    assert out.tokens == servers.ref_a[6]["output_ids"] and set(out.versions) == {"a"}
    assert greedy(servers.main, 6)["output_ids"] == greedy(servers.ref_b, 6)["output_ids"]
    restore_a(servers)
    out, answer = asyncio.run(run(abort_all=True))
    assert answer.json()["success"] is True
    assert out.meta["finish_reason"]["type"] == "abort" and len(out.tokens) < LONG
    assert out.tokens == servers.ref_a[6]["output_ids"][: len(out.tokens)]
    restore_a(servers)


def test_an_update_in_place_keeps_old_kv_out_of_every_other_request(servers: Servers) -> None:
    """Paused in place, updated, continued: the streams finish on their KV (tokens after the
    swap carry the new version), and a request with the same prompt sent while they run
    reads nothing from the cache and answers B's tokens exactly, as does one after."""

    async def run() -> tuple[list[Stream], dict[str, Any]]:
        outs = [Stream() for _ in range(4)]
        async with httpx.AsyncClient(base_url=servers.main.url, timeout=120) as client:
            tasks = [
                asyncio.create_task(stream(client, PROMPTS[i], long_sampling(), o))
                for i, o in enumerate(outs)
            ]
            await wait_for_tokens(outs)
            assert (await client.post("/pause_generation", json={"mode": "in_place"})).is_success
            answer = await client.post(
                "/update_weights_from_disk",
                json={"model_path": str(servers.b), "weight_version": "in-place"},
            )
            assert answer.json()["success"] is True
            assert (await client.post("/continue_generation")).is_success
            body = {"input_ids": PROMPTS[0], "sampling_params": long_sampling(16)}
            beside = (await client.post("/generate", json=body)).json()
            assert not all(task.done() for task in tasks)
            await asyncio.gather(*tasks)
        return outs, beside

    outs, beside = asyncio.run(run())
    for i, out in enumerate(outs):
        before = out.versions.count("a")
        assert out.versions == ["a"] * before + ["in-place"] * (LONG - before)
        assert out.tokens[:before] == servers.ref_a[i]["output_ids"][:before]
        assert out.meta["num_retractions"] == 0
    want = greedy(servers.ref_b, 0)["output_ids"]
    assert beside["output_ids"] == want and beside["meta_info"]["cached_tokens"] == 0
    assert greedy(servers.main, 0)["output_ids"] == want
    restore_a(servers)


CYCLES = 20
STREAMS = 64
SHORT = 24


def scheduler_rss(srv: ServerProcess) -> int:
    """The scheduler process's resident memory in kB."""
    (pid,) = [p for p, role in descendants(srv.proc.pid).items() if role == "scheduler"]
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def own_metric(srv: ServerProcess, line_start: str) -> float:
    with srv.client() as client:
        text = client.get("/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start)
    )


async def one_cycle(srv: ServerProcess, k: int, weights: Path) -> list[tuple[int, Stream]]:
    """64 greedy streams; once each has a token: pause (retract), update to ``weights`` as
    version vK, continue; every stream to its end."""
    outs = [(i % len(PROMPTS), Stream()) for i in range(STREAMS)]
    async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
        tasks = [
            asyncio.create_task(stream(client, PROMPTS[p], long_sampling(SHORT), o))
            for p, o in outs
        ]
        await wait_for_tokens([o for _, o in outs], at_least=1)
        assert (await client.post("/pause_generation", json={"mode": "retract"})).is_success
        body = {"model_path": str(weights), "weight_version": f"v{k}"}
        assert (await client.post("/update_weights_from_disk", json=body)).json()["success"]
        assert (await client.post("/continue_generation")).is_success
        await asyncio.gather(*tasks)
    return outs


def test_twenty_updates_under_64_streams_lose_nothing_and_leak_nothing(
    servers: Servers, tmp_path: Path
) -> None:
    """20 pause/update/continue cycles, each under 64 streams, weights alternating B and A:
    every stream finishes; its tokens carry the version before the cycle's update, then
    its own; those made before the swap are the old weights' exactly; each cycle's fresh
    request is the new weights' exactly. The scheduler's memory after the last cycle is
    that after the first (a staged copy of the weights per update would add 2.5 MB each),
    and a real Prometheus reads the updates, their durations and the paused seconds."""
    main = servers.main
    ref = {servers.a: servers.ref_a}
    ref[servers.b] = {i: greedy(servers.ref_b, i, LONG) for i in range(len(PROMPTS))}
    updates_before = own_metric(main, "tokenpipe:weight_updates_total{")
    with running_prometheus(main.port, tmp_path) as prom:
        previous, old_weights = "a", servers.a
        for k in range(1, CYCLES + 1):
            weights = servers.b if k % 2 else servers.a
            for p, out in asyncio.run(one_cycle(main, k, weights)):
                assert len(out.tokens) == SHORT, (k, out.meta)
                before = out.versions.count(previous)
                assert out.versions == [previous] * before + [f"v{k}"] * (SHORT - before)
                assert before >= 1
                assert out.tokens[:before] == ref[old_weights][p]["output_ids"][:before]
            fresh = greedy(main, k % len(PROMPTS), SHORT)
            assert fresh["output_ids"] == ref[weights][k % len(PROMPTS)]["output_ids"][:SHORT]
            assert fresh["meta_info"]["weight_version"] == f"v{k}"
            previous, old_weights = f"v{k}", weights
            if k == 1:
                time.sleep(0.5)  # the scheduler trims its heap when it goes idle
                rss_first = scheduler_rss(main)
        time.sleep(0.5)
        rss_last = scheduler_rss(main)
        assert rss_last - rss_first < 16 * 1024, (rss_first, rss_last)
        updates = own_metric(main, "tokenpipe:weight_updates_total{")
        assert updates - updates_before == CYCLES
        assert wait_until(
            lambda: scalar(prom, "sum(tokenpipe:weight_updates_total)") == updates, timeout=20
        ), "prometheus reads every update (ok and failed)"
        assert scalar(prom, "tokenpipe:weight_update_duration_seconds_count") == updates
        assert (scalar(prom, "tokenpipe:paused_seconds_total") or 0) > 0
        assert scalar(prom, "tokenpipe:generation_paused") == 0
    restore_a(servers)
