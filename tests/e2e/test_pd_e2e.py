"""PD disaggregation through real processes: a prefill server, a decode server whose KV pool
is too small for the load (so it retracts and re-bootstraps), and SGLang's router
(sglang-router) in front of them, as docs/operations.md deploys it. Every stream must equal the
unified server's greedy output, the first event after a re-bootstrap must show the prefill
side's new cached tokens, and a client that goes away must leave no request behind."""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server_harness import ServerProcess, free_port, wait_until
from tests.sglang_router import SglangRouter, router_binary

PROMPTS = [
    f"{word} is the first word of request number {i}"
    for i, word in enumerate(["Apple", "Bridge", "Cloud", "Desert", "Engine", "Forest"])
]
MAX_NEW = 80
DECODE_POOL = 320  # six requests of ~90 tokens at their peak: retractions are certain


@pytest.fixture(scope="module")
def pd_small(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServerProcess, ServerProcess, SglangRouter]]:
    router_binary()  # skip (or fail in CI) before starting anything
    base = tmp_path_factory.mktemp("pd-small")
    bootstrap_port = free_port()
    prefill = ServerProcess(
        base / "prefill",
        [
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(bootstrap_port),
        ],
    )
    decode = ServerProcess(
        base / "decode", ["--disaggregation-mode", "decode", "--max-total-tokens", str(DECODE_POOL)]
    )
    router: SglangRouter | None = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        # No retries: a failed request reaches the test instead of being sent again.
        args = [
            "--pd-disaggregation",
            "--prefill",
            prefill.url,
            str(bootstrap_port),
            "--decode",
            decode.url,
            "--disable-retries",
        ]
        router = SglangRouter(args, base / "router.log").wait_ready(workers=2)
        yield prefill, decode, router
    finally:
        if router is not None:
            router.stop()
        prefill.stop()
        decode.stop()


def _body(prompt: str, stream: bool) -> dict[str, object]:
    return {
        "text": prompt,
        "stream": stream,
        "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
    }


def _events(url: str, prompt: str) -> list[dict[str, object]]:
    with (
        httpx.Client(base_url=url, timeout=300) as client,
        client.stream("POST", "/generate", json=_body(prompt, True)) as response,
    ):
        assert response.status_code == 200, response.read()
        lines = [
            line.removeprefix("data: ")
            for line in response.iter_lines()
            if line.startswith("data: ")
        ]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.timeout(600)
def test_decode_retractions_rebootstrap_and_match_the_unified_server(
    server: ServerProcess, pd_small: tuple[ServerProcess, ServerProcess, SglangRouter]
) -> None:
    _, decode, router = pd_small
    with server.client() as unified:
        expected = [unified.post("/generate", json=_body(p, False)).json() for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        streams = list(pool.map(lambda p: _events(router.url, p), PROMPTS))

    retracted = 0
    for want, events in zip(expected, streams):
        assert all("error" not in e for e in events), events
        # Each event holds the output so far: a retraction never changes what was sent.
        for e in events:
            sent = e["output_ids"]
            assert sent == want["output_ids"][: len(sent)]  # type: ignore[arg-type, index]
            assert want["text"].startswith(str(e["text"]))  # type: ignore[attr-defined]
        assert events[-1]["output_ids"] == want["output_ids"] and events[-1]["text"] == want["text"]
        metas = [e["meta_info"] for e in events]
        final = metas[-1]
        assert final["prompt_tokens"] == want["meta_info"]["prompt_tokens"]  # type: ignore[index]
        assert (
            final["bootstrap_done_time"] is not None
            and final["decode_prebuilt_finish_time"] is not None
        )  # type: ignore[index]
        count = int(final["num_retractions"])  # type: ignore[index]
        retracted += count
        if count == 0:
            continue
        # The first event after a re-bootstrap (or several: a slow client's events merge) shows
        # the new count and the prefill side's new cached tokens: the whole prompt is in its
        # cache by then.
        first_after = next(
            m
            for m in metas
            if m["num_retractions"] >= 1  # type: ignore[index, operator]
        )
        assert first_after["cached_tokens"] == final["prompt_tokens"]  # type: ignore[index]
        assert metas[0]["cached_tokens"] < final["prompt_tokens"]  # type: ignore[index]
        assert (
            first_after["bootstrap_done_time"]  # type: ignore[index, operator]
            > metas[0]["bootstrap_done_time"]
        )
    assert retracted > 0, "the small decode pool never retracted: the test proves nothing"
    print(
        f"\nPD: {len(PROMPTS)} streams equal the unified server's after {retracted} decode-side "
        "re-bootstraps"
    )
    log = decode.output()
    assert log.count("re-bootstrapping its KV") == retracted
    with httpx.Client(base_url=decode.url) as client:
        info = client.get("/server_info").json()
    assert info["live_requests"] == 0 and info["engine_type"] == "decode"


LONG_REGEX = r"[a-z]{60,80}\."  # long answers: six at once outgrow the decode pool


@pytest.mark.timeout(600)
def test_constrained_streams_through_pd_match_the_unified_server(
    server: ServerProcess, pd_small: tuple[ServerProcess, ServerProcess, SglangRouter]
) -> None:
    """The prefill server draws the first token under the grammar's mask and the decode server
    goes on from it (through any re-bootstrap its small pool forces): each seeded stream equals
    the unified server's answer and follows the pattern."""
    _, _, router = pd_small

    def body(i: int, stream: bool) -> dict[str, object]:
        # sampling_seed, SGLang's name: sglang-router passes it on and drops an unknown `seed`.
        params = {
            "temperature": 1.0,
            "sampling_seed": 100 + i,
            "max_new_tokens": 100,
            "regex": LONG_REGEX,
        }
        return {"text": PROMPTS[i], "stream": stream, "sampling_params": params}

    with server.client() as unified:
        expected = [
            unified.post("/generate", json=body(i, False)).json() for i in range(len(PROMPTS))
        ]

    def streamed(i: int) -> dict[str, object]:
        with (
            httpx.Client(base_url=router.url, timeout=300) as client,
            client.stream("POST", "/generate", json=body(i, True)) as response,
        ):
            assert response.status_code == 200, response.read()
            lines = [
                line.removeprefix("data: ")
                for line in response.iter_lines()
                if line.startswith("data: ")
            ]
        assert lines[-1] == "[DONE]"
        last: dict[str, object] = json.loads(lines[-2])
        return last

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(streamed, range(len(PROMPTS))))
    for want, got in zip(expected, answers, strict=True):
        assert re.fullmatch(LONG_REGEX, str(want["text"])), want
        assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
        assert (
            got["meta_info"]["finish_reason"]  # type: ignore[index]
            == want["meta_info"]["finish_reason"]  # type: ignore[index]
        )


def _server_info(srv: ServerProcess) -> dict[str, object]:
    return httpx.get(srv.url + "/server_info", timeout=10).json()  # type: ignore[no-any-return]


def test_a_client_gone_mid_stream_is_aborted_on_the_decode_server(
    pd_small: tuple[ServerProcess, ServerProcess, SglangRouter],
) -> None:
    """sglang-router closes its connection to the decode server when its client goes away,
    and the decode server aborts the request on that disconnect instead of decoding on to
    ``max_new_tokens``."""
    prefill, decode, router = pd_small
    aborted_before = _server_info(decode)["aborted_requests"]
    body = {
        "text": "a long one",
        "stream": True,
        "sampling_params": {"max_new_tokens": DECODE_POOL - 50, "ignore_eos": True},
    }
    with router.client() as client, client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200, response.read()
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert "output_ids" in first
    assert wait_until(lambda: _server_info(decode)["live_requests"] == 0, 30, interval=0.1), (
        decode.output()[-2000:]
    )
    assert _server_info(decode)["aborted_requests"] == aborted_before + 1  # type: ignore[operator]
    assert _server_info(prefill)["live_requests"] == 0


def test_decode_server_fails_fast_when_the_prefill_peer_is_unreachable(
    pd_small: tuple[ServerProcess, ServerProcess, SglangRouter],
) -> None:
    _, decode, _ = pd_small
    body = {
        **_body("hello", False),
        "bootstrap_room": 7,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": free_port(),
    }
    started = time.monotonic()
    with decode.client() as client:
        response = client.post("/generate", json=body)
        streamed = client.post("/generate", json={**body, "stream": True, "bootstrap_room": 8})
    assert time.monotonic() - started < 10  # not the 30 s bootstrap timeout
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert (
        error["type"] == "bad_gateway"
        and "cannot connect to the prefill server at tcp://127.0.0.1:" in error["message"]
    )
    # A stream starts only with its first output: the refusal is the HTTP status too.
    assert streamed.status_code == 502 and "cannot connect" in streamed.json()["error"]["message"]


def test_decode_server_refuses_requests_without_bootstrap_fields(
    pd_small: tuple[ServerProcess, ServerProcess, SglangRouter],
) -> None:
    _, decode, _ = pd_small
    with decode.client() as client:
        missing = client.post("/generate", json=_body("hello", False))
        bad = client.post(
            "/generate",
            json={**_body("hello", False), "bootstrap_room": 1, "bootstrap_endpoint": "http://x:1"},
        )
        health = client.get("/health_generate")
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "bootstrap_room"
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "bootstrap_endpoint"
    assert health.status_code == 200  # its own 1-token check prefills locally


def test_metrics_carry_the_engine_type(
    pd_small: tuple[ServerProcess, ServerProcess, SglangRouter],
) -> None:
    prefill, decode, _ = pd_small
    for srv, engine in ((prefill, "prefill"), (decode, "decode")):
        text = httpx.get(srv.url + "/metrics").text
        assert f'engine_type="{engine}"' in text and 'engine_type="unified"' not in text


@pytest.mark.timeout(600)
def test_clients_that_go_away_leave_nothing_behind(
    pd_small: tuple[ServerProcess, ServerProcess, SglangRouter],
) -> None:
    """Streams cut at random points and impatient non-streaming clients, through the
    router, while others finish: afterwards neither server holds a request, the decode
    server's pool is empty, and the finished requests got all their tokens."""
    prefill, decode, router = pd_small
    rng = random.Random(11)
    plans = [
        ("cut", rng.randint(1, 20))
        if i % 3 == 0
        else ("impatient", rng.uniform(0.05, 0.3))
        if i % 3 == 1
        else ("finish", 0)
        for i in range(18)
    ]

    def client(i: int) -> str:
        kind, arg = plans[i]
        body = {
            "text": f"request {i} of the crowd",
            "sampling_params": {"max_new_tokens": 40, "ignore_eos": True},
        }
        try:
            if kind == "cut":
                with (
                    httpx.Client(base_url=router.url, timeout=120) as c,
                    c.stream("POST", "/generate", json={**body, "stream": True}) as r,
                ):
                    for n, _ in enumerate(
                        line for line in r.iter_lines() if line.startswith("data: ")
                    ):
                        if n + 1 >= arg:
                            return "cut"
                return "ended before the cut"
            if kind == "impatient":
                # 200 tokens take far longer than the client waits, even on a fast machine.
                params = {"max_new_tokens": 200, "ignore_eos": True}
                with httpx.Client(base_url=router.url, timeout=arg) as c:
                    c.post("/generate", json={**body, "sampling_params": params})
                return "answered in time"
            with httpx.Client(base_url=router.url, timeout=120) as c:
                out = c.post("/generate", json=body).json()
            return (
                "ok"
                if out["meta_info"]["completion_tokens"] == 40 == len(out["output_ids"])
                else f"short: {out}"
            )
        except httpx.TimeoutException:
            return "gave up"

    with ThreadPoolExecutor(len(plans)) as pool:
        results = list(pool.map(client, range(len(plans))))
    assert all(r == "ok" for r, (kind, _) in zip(results, plans) if kind == "finish"), results
    assert results.count("cut") >= 3 and results.count("gave up") >= 3, (
        results
    )  # the test cut something

    def idle(srv: ServerProcess) -> bool:
        info = httpx.get(srv.url + "/server_info", timeout=10).json()
        sched = info["scheduler"] or {}
        return (
            info["live_requests"] == 0
            and sched.get("live_reqs") == 0
            and sched.get("num_queue_reqs") == 0
        )

    assert wait_until(lambda: idle(decode) and idle(prefill), 30, interval=0.2), (
        results,
        decode.output()[-2000:],
    )
    sched = httpx.get(decode.url + "/server_info", timeout=10).json()["scheduler"]
    # Only the prefix cache may hold slots (a /health_generate prefills locally), never a request.
    assert (
        sched["token_usage"] == 0.0 and sched["kv_used_tokens"] == sched["cached_tokens_in_tree"]
    ), sched
