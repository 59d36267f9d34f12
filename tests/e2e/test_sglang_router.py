"""Scale-out behind the real sglang-router (SGLang's gateway, PyPI ``sglang-router``): two
data-parallel replicas with its cache-aware policy, and a prefill/decode pair with
``--pd-disaggregation``. Every route, streamed and not, goes through the router's own binary,
which re-serializes each body with its defaults and, in PD mode, adds the bootstrap fields."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_harness import ServerProcess, free_port, wait_until
from tests.e2e.test_kv_events import TOPIC, Subscriber
from tests.sglang_router import SglangRouter, router_binary

MODEL = "tokenpipe-tiny"
MESSAGES = [{"role": "user", "content": "Tell me about the sea"}]


def _post(client: httpx.Client, route: str, body: dict[str, Any]) -> dict[str, Any]:
    """A route's answer as one dict: the JSON answer, or the streamed events merged (the
    OpenAI routes' texts joined; a /generate stream's last event, which holds the whole
    output, after checking that each event holds the one before it)."""
    response = client.post(route, json=body)
    assert response.status_code == 200, (route, response.text)
    if not body.get("stream"):
        return response.json()  # type: ignore[no-any-return]
    lines = [
        line.removeprefix("data: ")
        for line in response.text.splitlines()
        if line.startswith("data: ")
    ]
    assert lines[-1] == "[DONE]", response.text
    events = [json.loads(line) for line in lines[:-1]]
    if route == "/generate":
        for before, after in zip(events, events[1:]):
            assert (
                after["text"].startswith(before["text"])
                and after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
            )
        return events[-1]  # type: ignore[no-any-return]
    key = "text" if route == "/v1/completions" else "delta"
    parts = [
        c[key] if key == "text" else c["delta"].get("content") or ""
        for e in events
        for c in e["choices"]
    ]
    return {"text": "".join(parts), "usage": events[-1].get("usage")}


def _text(route: str, answer: dict[str, Any]) -> str:
    if route == "/generate" or "choices" not in answer:
        return answer["text"]  # type: ignore[no-any-return]
    choice = answer["choices"][0]
    text = choice["text"] if route == "/v1/completions" else choice["message"]["content"]
    return text  # type: ignore[no-any-return]


def _bodies(prompt: str, stream: bool) -> dict[str, dict[str, Any]]:
    greedy = {"temperature": 0, "ignore_eos": True}
    options = {"stream_options": {"include_usage": True}} if stream else {}
    return {
        "/generate": {"text": prompt, "sampling_params": {"max_new_tokens": 8, **greedy},
            "stream": stream},
        "/v1/completions": {"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": stream,
            **greedy, **options},
        "/v1/chat/completions": {
            "model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
            "stream": stream, **greedy, **options,
        },
    }  # fmt: skip


def _requests_served(server: ServerProcess) -> float:
    with server.client() as c:
        metrics = c.get("/metrics").text
    return sum(
        float(v)
        for v in re.findall(r"^tokenpipe:num_requests_total\{[^}]*\} (\S+)$", metrics, re.M)
    )


# --- data-parallel replicas ------------------------------------------------------------------


@pytest.fixture(scope="module")
def replicas(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[SglangRouter, list[ServerProcess]]]:
    router_binary()  # skip (or fail in CI) before starting anything
    base = tmp_path_factory.mktemp("replicas")
    servers = [ServerProcess(base / f"replica{i}" / "tmp") for i in range(2)]
    router: SglangRouter | None = None
    try:
        for s in servers:
            s.wait_ready()
        # Low balance thresholds: the cache-aware policy turns to the least loaded replica as
        # soon as in-flight counts differ, so a burst spreads over both.
        balance = ["--balance-abs-threshold", "1", "--balance-rel-threshold", "1.0"]
        router = SglangRouter(
            ["--worker-urls", *(s.url for s in servers), *balance], base / "router.log"
        ).wait_ready(workers=2)
        yield router, servers
    finally:
        if router is not None:
            router.stop()
        for s in servers:
            s.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_every_route_through_the_router_answers_as_a_replica_does(
    replicas: tuple[SglangRouter, list[ServerProcess]], stream: bool
) -> None:
    router, servers = replicas
    with router.client() as via_router, servers[0].client() as direct:
        for i in range(3):
            for route, body in _bodies(f"Story number {i} about a lighthouse", stream).items():
                got, want = _post(via_router, route, body), _post(direct, route, body)
                assert _text(route, got) == _text(route, want), route
                if route == "/generate":
                    assert (
                        got["output_ids"] == want["output_ids"]
                        and got["meta_info"]["completion_tokens"] == 8
                    )
                elif stream:
                    assert got["usage"]["completion_tokens"] == 8
                else:
                    assert got["usage"]["completion_tokens"] == 8


def test_both_replicas_serve_and_a_shared_prefix_is_cached(
    replicas: tuple[SglangRouter, list[ServerProcess]],
) -> None:
    router, servers = replicas
    before = [_requests_served(s) for s in servers]
    prefix = "In a quiet harbour town there lived an old keeper who " * 8
    with router.client() as client:
        burst = {"sampling_params": {"max_new_tokens": 48, "ignore_eos": True}, "stream": True}
        with ThreadPoolExecutor(16) as pool:
            answers = list(
                pool.map(
                    lambda i: _post(client, "/generate", {"text": f"burst {i}", **burst}), range(16)
                )
            )
        assert all(a["meta_info"]["completion_tokens"] == 48 for a in answers)
        first = _post(
            client,
            "/generate",
            {"text": prefix + "first", "sampling_params": {"max_new_tokens": 2}},
        )
        second = _post(
            client,
            "/generate",
            {"text": prefix + "second", "sampling_params": {"max_new_tokens": 2}},
        )
        chat = _post(
            client,
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": prefix + "third"}],
                "max_tokens": 2,
            },
        )
    served = [_requests_served(s) - b for s, b in zip(servers, before)]
    assert all(n > 0 for n in served), served
    # The cache-aware policy sends a prompt to the replica that holds its prefix.
    assert first["meta_info"]["cached_tokens"] < second["meta_info"]["cached_tokens"]
    assert second["meta_info"]["cached_tokens"] > second["meta_info"]["prompt_tokens"] // 2
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_a_dp_aware_router_reaches_each_replicas_one_rank(
    replicas: tuple[SglangRouter, list[ServerProcess]], tmp_path: Path
) -> None:
    """``--dp-aware`` reads each replica's ``dp_size`` (1) and sends ``data_parallel_rank``
    0 with every body: served like any other request."""
    _, servers = replicas
    router = SglangRouter(
        ["--worker-urls", *(s.url for s in servers), "--dp-aware"], tmp_path / "router.log"
    ).wait_ready(workers=2)
    try:
        assert sorted(w["url"] for w in router.workers()) == sorted(f"{s.url}@0" for s in servers)
        with router.client() as client:
            for route, body in _bodies("A rank of its own", stream=False).items():
                assert _post(client, route, body)
    finally:
        router.stop()


# --- prefill/decode disaggregation -------------------------------------------------------------


@pytest.fixture(scope="module")
def pd_events() -> dict[str, tuple[int, int]]:
    """The KV event ports (publisher, replay) of the PD pair's prefill and decode servers."""
    return {role: (free_port(), free_port()) for role in ("prefill", "decode")}


def _events_args(ports: tuple[int, int]) -> list[str]:
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{ports[0]}",
        "replay_endpoint": f"tcp://*:{ports[1]}",
        "topic": TOPIC,
    }
    return ["--kv-events-config", json.dumps(config)]


@pytest.fixture(scope="module")
def pd(
    tmp_path_factory: pytest.TempPathFactory, pd_events: dict[str, tuple[int, int]]
) -> Iterator[SglangRouter]:
    router_binary()
    base = tmp_path_factory.mktemp("pd")
    bootstrap_port = free_port()
    prefill = ServerProcess(
        base / "prefill" / "tmp",
        [
            "--disaggregation-mode",
            "prefill",
            "--disaggregation-bootstrap-port",
            str(bootstrap_port),
            *_events_args(pd_events["prefill"]),
        ],
    )
    decode = ServerProcess(
        base / "decode" / "tmp",
        ["--disaggregation-mode", "decode", *_events_args(pd_events["decode"])],
    )
    router: SglangRouter | None = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        args = [
            "--pd-disaggregation",
            "--prefill",
            prefill.url,
            str(bootstrap_port),
            "--decode",
            decode.url,
        ]
        router = SglangRouter(args, base / "router.log").wait_ready(workers=2)
        yield router
    finally:
        if router is not None:
            router.stop()
        prefill.stop()
        decode.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_pd_through_the_router_equals_a_unified_server(
    pd: SglangRouter, server: ServerProcess, stream: bool
) -> None:
    with pd.client() as via_router, server.client() as unified:
        for route, body in _bodies("The lighthouse keeper opened the door and", stream).items():
            got, want = _post(via_router, route, body), _post(unified, route, body)
            assert _text(route, got) == _text(route, want), route
            if route == "/generate":
                assert got["output_ids"] == want["output_ids"]
                assert got["meta_info"]["prompt_tokens"] == want["meta_info"]["prompt_tokens"]
            else:
                assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"] == 8


def test_pd_salts_key_the_prefill_cache_and_only_the_prefill_server_publishes_blocks(
    pd: SglangRouter, pd_events: dict[str, tuple[int, int]]
) -> None:
    """Through the router, the prefill server's cache is salted as a unified server's is, and
    its events announce the salted blocks; the decode server, whose KV arrives per request
    and is never cached, announces none. (sglang-router 0.3.2 forwards ``cache_salt`` on
    the OpenAI routes; its /generate drops the field: docs/operations.md.)"""
    subs = {
        role: Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
        for role, (pub, replay) in pd_events.items()
    }
    prefill = subs["prefill"]
    text = " ".join(str((7 * i + 3) % 900 + 20) for i in range(40))
    try:
        with pd.client() as client:

            def cached(salt: str) -> tuple[int, int]:
                body = {"model": MODEL, "prompt": text, "max_tokens": 4, "cache_salt": salt}
                usage = _post(client, "/v1/completions", body)["usage"]
                return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]

            before = len(prefill.stored)
            assert cached("pd-a")[0] == 0
            assert wait_until(lambda: prefill.poll() or len(prefill.stored) > before, 30)
            assert prefill.stored[-1].extra_keys[0] == ("pd-a",)  # type: ignore[index]
            assert cached("pd-b")[0] == 0
            hit, prompt_tokens = cached("pd-a")
            assert hit == prompt_tokens - 1
        subs["decode"].poll(300)
        assert subs["decode"].stored == []
    finally:
        for sub in subs.values():
            sub.ctx.destroy(linger=0)


def _logprob_entries(
    route_answer: dict[str, Any], events: list[dict[str, Any]] | None = None
) -> dict[str, list[Any]]:
    """The logprob keys of a /generate answer, or of its stream's last event (each event
    holds the prompt's and those of every token so far, as SGLang streams them)."""
    if events is None:
        return {k: v for k, v in route_answer["meta_info"].items() if k.endswith("_logprobs")}
    for e in events:
        assert len(e["meta_info"]["output_token_logprobs"]) == len(e["output_ids"]), (
            "an event's entries are its ids'"
        )
        assert all(
            e["meta_info"][k] == v
            for k, v in events[-1]["meta_info"].items()
            if k.startswith("input_")
        ), "the prompt's on each"
    return _logprob_entries(events[-1])


def _values(entries: Any) -> list[float]:
    """Every logprob in a nested list of ``[logprob, id, text]`` entries (None: position 0)."""
    if entries is None:
        return []
    if len(entries) == 3 and not isinstance(entries[0], list) and isinstance(entries[1], int):
        return [] if entries[0] is None else [entries[0]]
    return [x for e in entries for x in _values(e)]


def _strip_values(entries: Any) -> Any:
    if entries is None or (
        len(entries) == 3 and not isinstance(entries[0], list) and isinstance(entries[1], int)
    ):
        return entries if entries is None else entries[1:]
    return [_strip_values(e) for e in entries]


@pytest.mark.parametrize("stream", [False, True])
def test_pd_logprobs_through_the_router_equal_a_unified_server(
    pd: SglangRouter, server: ServerProcess, stream: bool
) -> None:
    """sglang-router, in PD mode, joins the prefill answer's ``input_token_logprobs`` in
    front of the decode answer's; tokenpipe's prefill half lists none (the decode side
    does), so the router's answer lists each prompt position once, and every key equals a
    unified server's: no entry twice, none missing."""
    body = {
        "text": "The lighthouse keeper opened the door and",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2, "stream": stream,
    }  # fmt: skip
    with pd.client() as via_router, server.client() as unified:
        want = unified.post("/generate", json={**body, "stream": False}).json()
        response = via_router.post("/generate", json=body)
    assert response.status_code == 200, response.text
    if stream:
        lines = [
            line.removeprefix("data: ")
            for line in response.text.splitlines()
            if line.startswith("data: ")
        ]
        got = _logprob_entries({}, [json.loads(line) for line in lines[:-1]])
    else:
        got = _logprob_entries(response.json())
    expected = _logprob_entries(want)
    assert (
        sorted(got)
        == sorted(expected)
        == sorted(f"{side}_{k}_logprobs" for side in ("input", "output") for k in ("token", "top"))
    )
    assert len(expected["input_token_logprobs"]) == want["meta_info"]["prompt_tokens"]
    assert len(expected["output_token_logprobs"]) == 8
    for key in expected:
        assert _strip_values(got[key]) == _strip_values(expected[key]), key
        assert _values(got[key]) == pytest.approx(_values(expected[key]), abs=1e-5), key


def test_the_router_log_names_no_refused_request(
    pd: SglangRouter, replicas: tuple[SglangRouter, list[ServerProcess]]
) -> None:
    """Every body the router re-serialized was accepted: no 4xx from a worker in its logs."""
    for log in (pd.log_path, replicas[0].log_path):
        text = Path(log).read_text()
        assert " 400 " not in text and "Bad Request" not in text, text[-2000:]


def test_pd_priority_reaches_the_pair_through_the_router(pd: SglangRouter) -> None:
    """sglang-router forwards ``priority`` on /generate and /v1/completions: the pair runs
    without priority scheduling, so each half answers vLLM's 400 for a non-zero priority,
    which only a forwarded field can cause (docs/operations.md: its chat route drops it).
    Last in the module, after the check that the router's log names no refused request."""
    bodies = {
        "/generate": {"text": "hello there", "sampling_params": {"max_new_tokens": 2}},
        "/v1/completions": {"model": MODEL, "prompt": "hello there", "max_tokens": 2},
    }
    with pd.client() as client:
        for route, body in bodies.items():
            assert client.post(route, json=body).status_code == 200
            refused = client.post(route, json={**body, "priority": 3})
            assert refused.status_code == 400, (route, refused.text)
            assert "Priority scheduling is not enabled" in refused.text
