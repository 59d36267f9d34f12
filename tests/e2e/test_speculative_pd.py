"""Speculative decoding on the decode side of a prefill/decode pair behind the real
sglang-router (issue 42's proof): one prefill server and two decode servers, one drafting
with prompt lookup (in a pool small enough that its running batch retracts, so retracted
requests are fetched from the prefill server again) and one with a draft model (which reads
each prompt into its own KV, since the prefill server sends the target's only). The router
takes turns between them. Every answer, greedy, seeded and sharp, streamed or not, by
/generate and the OpenAI routes, equals a unified server's that does not speculate, and
each decode server verified and accepted drafts.

All four servers run deterministic inference on one thread (tests/speculative_helpers.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.server_harness import ServerProcess, free_port, wait_until
from tests.sglang_router import SglangRouter, router_binary
from tests.speculative_helpers import (
    ALWAYS,
    DETERMINISTIC,
    generate,
    ngram_args,
    retractions,
    spec_metrics,
    standalone_args,
    streamed_generate,
    total_counts,
    write_layer_draft,
    write_target,
)

MODEL = "tiny"
PROMPTS = [
    "The lighthouse keeper opened the door and",
    "Seven ships sailed from the harbour at dawn, carrying salt. Seven ships sailed from the",
    "x1 = x0 + 1\nx2 = x1 + 1\nx3 = x2 + 1\n",
    "rain over roofs, rain over roofs, rain over",
    "The committee met on Tuesday to decide whether",
    "def f(x): return x + 1\n",
]
SAMPLINGS: list[dict[str, Any]] = [
    {"temperature": 0},
    {"temperature": 1.0, "top_p": 0.9, "seed": 7},
    {"temperature": 0.1, "top_k": 8, "seed": 11},
]
NEW_TOKENS = 32


@dataclass
class Deployment:
    router: SglangRouter
    unified: ServerProcess
    decoders: dict[str, ServerProcess]


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    router_binary()
    root = tmp_path_factory.mktemp("speculative-pd")
    write_target(root / "target")
    write_layer_draft(root / "target", root / "draft")
    common = [
        "--model-path", str(root / "target"), "--served-model-name", MODEL, *DETERMINISTIC,
        "--torch-threads", "1", "--metrics-compat", "vllm",
    ]  # fmt: skip
    bootstrap_port = free_port()
    decode = ["--disaggregation-mode", "decode"]
    servers = {
        "prefill": [
            "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
            str(bootstrap_port),
        ],
        # 96 slots: a prompt and its 32 tokens fit, two at once do not.
        "ngram": [*decode, *ngram_args(), *ALWAYS, "--max-total-tokens", "96"],
        "standalone": [*decode, *standalone_args(root / "draft"), *ALWAYS],
        "unified": [],
    }  # fmt: skip
    started = {
        name: ServerProcess(root / name / "tmp", [*common, *args]) for name, args in servers.items()
    }
    router: SglangRouter | None = None
    try:
        for server in started.values():
            server.wait_ready()
        args = ["--pd-disaggregation", "--prefill", started["prefill"].url, str(bootstrap_port)]
        args += ["--decode", started["ngram"].url, "--decode", started["standalone"].url]
        router = SglangRouter(args, root / "router.log", policy="round_robin")
        router.wait_ready(workers=3)
        decoders = {name: started[name] for name in ("ngram", "standalone")}
        yield Deployment(router, started["unified"], decoders)
    finally:
        if router is not None:
            router.stop()
        with ThreadPoolExecutor(len(started)) as pool:
            list(pool.map(ServerProcess.stop, started.values()))


def _generate_bodies() -> list[dict[str, Any]]:
    """/generate bodies with the seed under SGLang's name, ``sampling_seed``: the router
    re-serializes sampling_params as SGLang's fields, and drops a ``seed``."""
    bodies = []
    for prompt in PROMPTS:
        for sampling in SAMPLINGS:
            params = {k: v for k, v in sampling.items() if k != "seed"}
            if "seed" in sampling:
                params["sampling_seed"] = sampling["seed"]
            params["max_new_tokens"] = NEW_TOKENS
            bodies.append({"text": prompt, "sampling_params": params})
    return bodies


@pytest.fixture(scope="module")
def unified_answers(pd: Deployment) -> list[dict[str, Any]]:
    with pd.unified.client() as client:
        return [generate(client, body) for body in _generate_bodies()]


def assert_same(bodies: list[Any], got: list[Any], want: list[Any]) -> None:
    for body, g, w in zip(bodies, got, want, strict=True):
        first = next(
            (i for i, (a, b) in enumerate(zip(g["output_ids"], w["output_ids"])) if a != b),
            min(len(g["output_ids"]), len(w["output_ids"])),
        )
        assert (g["text"], g["output_ids"]) == (w["text"], w["output_ids"]), (
            f"{body}\n  via PD: {g['output_ids']}\n  unified: {w['output_ids']}\n"
            f"  first differing index {first}"
        )
        assert g["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"], body


def test_one_at_a_time_through_the_router_equals_a_unified_plain_server(
    pd: Deployment, unified_answers: list[dict[str, Any]]
) -> None:
    """18 requests (6 prompts, greedy, seeded and sharp) one after another: the router
    takes turns, so each decode server answers 9, alone in its batch with room for drafts,
    and both verify and accept drafts."""
    bodies = _generate_bodies()
    accepted = {name: _watch(server, _accepted) for name, server in pd.decoders.items()}
    with pd.router.client() as client:
        got = [generate(client, body) for body in bodies]
    assert_same(bodies, got, unified_answers)
    counts = total_counts([g["meta_info"] for g in got])
    assert counts.verify_ct > 0 and counts.accepted_tokens > 0, counts
    for name, rose in accepted.items():
        assert rose(), f"the {name} decode server accepted no draft"


def test_all_at_once_streamed_through_the_router_equals_a_unified_plain_server(
    pd: Deployment, unified_answers: list[dict[str, Any]]
) -> None:
    """The 18 requests streamed all at once: each decode server runs a batch of 9, and the
    small one (96 slots for about 400 tokens) retracts some and fetches them again."""
    bodies = _generate_bodies()
    retracted = _watch(pd.decoders["ngram"], retractions)
    with pd.router.client() as client, ThreadPoolExecutor(len(bodies)) as pool:
        got = list(pool.map(lambda body: streamed_generate(client, body), bodies))
    assert_same(bodies, got, unified_answers)
    assert retracted(), "the small decode server retracted nothing"


def _accepted(client: httpx.Client) -> float:
    return spec_metrics(client).get("vllm:spec_decode_num_accepted_tokens", 0.0)


def _watch(server: ServerProcess, read: Callable[[httpx.Client], float]) -> Callable[[], bool]:
    """A check, for after the caller's traffic, that ``read`` of the server's /metrics rose
    above its value now (within 30 s: /metrics has a scheduler's counts after its next stats
    report)."""
    with server.client() as client:
        before = read(client)

    def rose() -> bool:
        with server.client() as client:
            return wait_until(lambda: read(client) > before, 30)

    return rose


def _openai_bodies() -> list[tuple[str, dict[str, Any]]]:
    made = []
    for prompt in PROMPTS[:4]:
        for sampling in SAMPLINGS:
            common = {"model": MODEL, "max_tokens": NEW_TOKENS, **sampling}
            made.append(("/v1/completions", {**common, "prompt": prompt}))
            messages = [{"role": "user", "content": prompt}]
            made.append(("/v1/chat/completions", {**common, "messages": messages}))
    return made


def _openai_text(client: httpx.Client, route: str, body: dict[str, Any]) -> str:
    response = client.post(route, json=body)
    assert response.status_code == 200, (route, body, response.text)
    choice = response.json()["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


def test_openai_routes_through_the_router_equal_a_unified_plain_server(pd: Deployment) -> None:
    cases = _openai_bodies()
    with pd.unified.client() as alone:
        want = [_openai_text(alone, route, body) for route, body in cases]
    with pd.router.client() as client, ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda case: _openai_text(client, *case), cases))
    for case, g, w in zip(cases, got, want):
        assert g == w, (case, g, w)
