"""LoRA adapters behind the real sglang-router in front of a prefill/decode pair: each server
serves the same checkpoint and adapters (written by peft), the router re-serializes each
body and adds the bootstrap fields, and every answer, by OpenAI ``model`` and by SGLang's
``lora_path``, streamed and not, equals a unified server's. The decode server's pool is small,
so concurrent answers are retracted there and re-bootstrapped: the prefill server computes
their KV again with the adapter the fetch names (``KVFetch.lora``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.hf_checkpoints import write_case
from tests.lora_adapters import write_adapter
from tests.server_harness import ServerProcess, free_port
from tests.sglang_router import SglangRouter, router_binary

BASE = "tiny-base"
PROMPTS = [
    "The lighthouse keeper opened the door and",
    "Seven ships sailed from the harbour at dawn, carrying",
    "def fib(n):\n    if n < 2:",
    "The committee met on Tuesday to decide whether",
]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[SglangRouter, ServerProcess, ServerProcess]]:
    """The router in front of the pair, a unified server, and the pair's decode server."""
    router_binary()
    root = tmp_path_factory.mktemp("lora-pd")
    write_case(root / "base", "llama3")
    modules = [
        f"sql={write_adapter(root / 'base', root / 'sql', rank=8, alpha=16, seed=1)}",
        f"chat={write_adapter(root / 'base', root / 'chat', rank=4, alpha=4, seed=2)}",
    ]
    common = [
        "--model-path", str(root / "base"), "--served-model-name", BASE,
        "--lora-modules", *modules, "--max-loras", "2", "--max-lora-rank", "8",
        "--enable-deterministic-inference", "--torch-threads", "1",
    ]  # fmt: skip
    bootstrap_port = free_port()
    prefill = ServerProcess(
        root / "prefill" / "tmp",
        [*common, "--disaggregation-mode", "prefill"]
        + ["--disaggregation-bootstrap-port", str(bootstrap_port)],
    )
    # 4 answers of 12-token prompts and 10 new tokens need 88 slots: 64 retract some.
    decode = ServerProcess(
        root / "decode" / "tmp",
        [*common, "--disaggregation-mode", "decode", "--max-total-tokens", "64"],
    )
    unified = ServerProcess(root / "unified" / "tmp", common)
    router: SglangRouter | None = None
    try:
        for server in (prefill, decode, unified):
            server.wait_ready()
        args = ["--pd-disaggregation", "--prefill", prefill.url, str(bootstrap_port)]
        router = SglangRouter([*args, "--decode", decode.url], root / "router.log")
        yield router.wait_ready(workers=2), unified, decode
    finally:
        if router is not None:
            router.stop()
        for server in (prefill, decode, unified):
            server.stop()


def _bodies(prompt: str, adapter: str | None, stream: bool) -> dict[str, dict[str, Any]]:
    greedy = {"temperature": 0, "ignore_eos": True}
    model = adapter or BASE
    return {
        "/generate": {"text": prompt, "sampling_params": {"max_new_tokens": NEW_TOKENS, **greedy},
            "lora_path": adapter, "stream": stream},
        "/v1/completions": {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS,
            "stream": stream, **greedy},
        "/v1/chat/completions": {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": NEW_TOKENS, "stream": stream, **greedy},
    }  # fmt: skip


def _answer(client: httpx.Client, route: str, body: dict[str, Any]) -> tuple[str, Any]:
    """The answer's text, and its token ids (/generate) or usage (OpenAI routes)."""
    response = client.post(route, json=body)
    assert response.status_code == 200, (route, body, response.text)
    if not body["stream"]:
        data = response.json()
        if route == "/generate":
            return data["text"], data["output_ids"]
        choice = data["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        return text, data["usage"]["completion_tokens"]
    events = [
        json.loads(line.removeprefix("data: "))
        for line in response.text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]
    if route == "/generate":
        return "".join(e["text"] for e in events), [i for e in events for i in e["output_ids"]]
    choices = [c for e in events for c in e["choices"]]
    text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices)
    return text, None


@pytest.mark.parametrize("stream", [False, True])
def test_adapters_through_the_router_and_a_pd_pair_equal_a_unified_server(
    servers: tuple[SglangRouter, ServerProcess, ServerProcess], stream: bool
) -> None:
    router, unified, _ = servers
    cases = [
        (prompt, adapter, route, body)
        for prompt in PROMPTS
        for adapter in ("sql", "chat", None)
        for route, body in _bodies(prompt, adapter, stream).items()
    ]
    with router.client() as via_router, unified.client() as alone:
        want = [_answer(alone, route, body) for _, _, route, body in cases]
        # Concurrently through the pair: the decode server's small pool retracts some.
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda c: _answer(via_router, c[2], c[3]), cases))
    for case, g, w in zip(cases, got, want):
        assert g == w, case[:3]
    # The adapters change the answers (else the comparison would prove little).
    texts = {(p, a): w[0] for (p, a, r, _), w in zip(cases, want) if r == "/generate"}
    for adapter in ("sql", "chat"):
        assert all(texts[(p, adapter)] != texts[(p, None)] for p in PROMPTS), adapter


def test_the_decode_server_retracted_and_refetched_with_the_adapter(
    servers: tuple[SglangRouter, ServerProcess, ServerProcess],
) -> None:
    """The comparison above ran with retractions on the decode side, so its re-bootstraps
    named their adapter to the prefill server (or the answers would have differed)."""
    with servers[2].client() as client:
        metrics = client.get("/metrics").text
    retracted = [
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("tokenpipe:num_retracted_requests_total")
    ]
    assert retracted and sum(retracted) > 0, retracted
