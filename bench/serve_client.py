"""The load client of bench/serve.py: the workload's request bodies, and one request sent
and read (``send_one``).

Prompts are random token ids (words for chat), different for every request so the prefix
cache cannot share them. Per request it measures, client side, TTFT, ITL (the gap before
each later event divided by the tokens in it), end-to-end latency and the tokens received; a
request whose tokens differ from its final ``completion_tokens`` counts as tokens lost. A
/generate stream's tokens are its events' ``output_ids`` (summed when each event holds its
new tokens, the last event's when each holds the output so far); OpenAI chunks carry no
token ids, so there an event's tokens are its ``usage.completion_tokens`` less the previous
event's (the count the chunks carry, not their text). Each API's body: bench/README.md.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

DEFAULT_TEMPERATURE = 0.7
ENDPOINTS = {
    "generate": "/generate",
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}  # --api
FIRST_ID = 16  # prompts draw ids from here up: the low ids hold the special tokens
PROMPT_HEAD = 4  # a chain prompt's random ids before its chain
USAGE_COUNTED = ("completions", "chat")  # the APIs whose chunks are counted by their usage
# Usage so far on every chunk: a chunk's text holds one or more tokens (or none yet), and
# the default server sends no token ids in completions chunks, so this is how to count them.
CONTINUOUS_USAGE = {"include_usage": True, "continuous_usage_stats": True}
# Chat prompts are text: common words, most of them one token in a BPE vocabulary, drawn at
# random per request so that no two prompts share a prefix beyond the chat template's.
PROMPT_WORDS = tuple(
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city name".split()
)


@dataclass
class LoadConfig:
    concurrency: int = 64
    requests: int = 256
    stream_ratio: float = 0.5
    max_new_tokens: int = 64
    prompt_len: int = 32
    seed: int = 0
    progress: bool = True
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float | None = None  # None: not sent (the server's default, 1.0)
    seeded: bool = True  # a distinct seed per request: seed + its index
    prompt_set: int = 0  # runs on one server with different sets share no prompt
    top_logprobs: int | None = (
        None  # None: no logprobs asked; K: return_logprob, top_logprobs_num K
    )
    api: str = "generate"  # a key of ENDPOINTS
    json_schema: str | None = (
        None  # None: unconstrained; a JSON schema's text: every answer follows it
    )
    tools: str | None = (
        None  # chat only. None: no tools; a JSON list of tools: sent with tool_choice
    )
    tool_choice: str = "required"  # with tools: "none", "auto" or "required"
    # LoRA: request i names lora_names[i % len] (None: the base model); empty: no adapter.
    lora_names: tuple[str | None, ...] = ()
    # A permutation's successors (bench/copy_checkpoint.py's sigma): each prompt is then
    # chain_prompt's, which the copy checkpoint's answer repeats; empty: random ids.
    prompt_chain: tuple[int, ...] = ()


@dataclass
class ReqResult:
    stream: bool
    ok: bool = False
    status: int = 0
    error: str | None = None
    sent: float = 0.0  # seconds since the run's start
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0  # output_ids received
    completion_tokens: int | None = None  # the final meta_info's count
    logprobs: int | None = None  # output_token_logprobs entries received; None: not asked
    tool_calls: int = 0  # calls a chat stream's chunks opened
    itl: list[float] = field(default_factory=list)
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, tokens)


# --- requests ---------------------------------------------------------------------------------


def make_body(i: int, cfg: LoadConfig, vocab: int, stream: bool) -> dict[str, Any]:
    """Request ``i``'s body; its adapter, if it has one, named as the API takes it: SGLang's
    ``lora_path`` on /generate, OpenAI's ``model`` on the others."""
    body = workload_body(i, cfg, vocab, stream)
    adapter = cfg.lora_names[i % len(cfg.lora_names)] if cfg.lora_names else None
    if adapter is not None:
        body["lora_path" if cfg.api == "generate" else "model"] = adapter
    return body


def workload_body(i: int, cfg: LoadConfig, vocab: int, stream: bool) -> dict[str, Any]:
    rng = random.Random(f"{cfg.seed}/{cfg.prompt_set}/{i}")
    ids = (
        chain_prompt(cfg.prompt_chain, rng, cfg.prompt_len)
        if cfg.prompt_chain
        else [rng.randrange(FIRST_ID, vocab) for _ in range(cfg.prompt_len)]
    )
    if cfg.api == "completions":
        return completions_body(i, cfg, ids, stream)
    if cfg.api == "chat":
        return chat_body(i, cfg, rng, stream)
    sampling: dict[str, Any] = {
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "ignore_eos": True,
    }
    if cfg.top_p is not None:
        sampling["top_p"] = cfg.top_p
    if cfg.seeded:
        sampling["seed"] = cfg.seed + i
    if cfg.json_schema is not None:
        sampling["json_schema"] = cfg.json_schema
    body = {"input_ids": ids, "sampling_params": sampling, "stream": stream}
    if cfg.top_logprobs is not None:
        body.update(return_logprob=True, top_logprobs_num=cfg.top_logprobs)
    return body


def chain_prompt(successors: Sequence[int], rng: random.Random, length: int) -> list[int]:
    """``PROMPT_HEAD`` random ids (no two prompts share a prefix), then a chain from a random
    id, each next id the successor of the one before, up to ``length`` ids."""
    head = [rng.randrange(FIRST_ID, len(successors)) for _ in range(min(PROMPT_HEAD, length))]
    chain = [rng.randrange(FIRST_ID, len(successors))]
    while len(head) + len(chain) < length:
        chain.append(successors[chain[-1]])
    return (head + chain)[:length]


def completions_body(i: int, cfg: LoadConfig, ids: list[int], stream: bool) -> dict[str, Any]:
    """The same request as ``make_body``'s /generate one, as a /v1/completions body."""
    assert cfg.top_logprobs is None, "logprobs are measured through /generate"
    return openai_body({"prompt": ids}, i, cfg, stream)


def openai_body(body: dict[str, Any], i: int, cfg: LoadConfig, stream: bool) -> dict[str, Any]:
    """``body`` (the prompt) with the workload's OpenAI fields: ``max_tokens``,
    ``temperature``, ``ignore_eos``, ``top_p``, ``seed``, the JSON schema as
    ``response_format``, and a stream's usage on every chunk."""
    body.update(max_tokens=cfg.max_new_tokens, temperature=cfg.temperature, ignore_eos=True)
    if cfg.top_p is not None:
        body["top_p"] = cfg.top_p
    if cfg.seeded:
        body["seed"] = cfg.seed + i
    if cfg.json_schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "bench", "schema": json.loads(cfg.json_schema)},
        }
    body["stream"] = stream
    if stream:
        body["stream_options"] = dict(CONTINUOUS_USAGE)
    return body


def chat_body(i: int, cfg: LoadConfig, rng: random.Random, stream: bool) -> dict[str, Any]:
    """The same request as a /v1/chat/completions body: one user message of
    ``cfg.prompt_len`` random words, and ``cfg.tools`` with ``cfg.tool_choice``."""
    assert cfg.top_logprobs is None, "logprobs are measured through /generate"
    words = " ".join(rng.choice(PROMPT_WORDS) for _ in range(cfg.prompt_len))
    body: dict[str, Any] = {"messages": [{"role": "user", "content": words}]}
    if cfg.tools is not None:
        body["tools"] = json.loads(cfg.tools)
        body["tool_choice"] = cfg.tool_choice
    return openai_body(body, i, cfg, stream)


def generate_event_tokens(event: dict[str, Any], res: ReqResult) -> int:
    """A /generate event's new tokens; keeps its ``meta_info`` count so far and its logprob
    entries. A server with ``--incremental-streaming-output`` sends each event's new ids
    only; by default (SGLang's) each event holds every id so far. Once an earlier event had
    tokens, only the latter holds all ``completion_tokens`` of the event, so each event says
    which it is (before that the two read the same); a cumulative event that lost a token
    reads as incremental and is counted over, so the loss still shows."""
    ids, meta = event["output_ids"], event["meta_info"]
    before = res.completion_tokens or 0
    res.completion_tokens = meta["completion_tokens"]
    cumulative = before > 0 and len(ids) == res.completion_tokens
    if res.logprobs is not None:
        entries = len(meta.get("output_token_logprobs") or ())
        res.logprobs = entries if cumulative else res.logprobs + entries
    return len(ids) - res.tokens if cumulative else len(ids)


def usage_event_tokens(event: dict[str, Any], res: ReqResult) -> int:
    """A /v1/completions or /v1/chat/completions chunk's tokens: its usage so far
    (``continuous_usage_stats``) less the tokens counted before it. The last chunk (no
    choices) carries the request's usage: its ``completion_tokens`` is the final count,
    checked against the sum. A chat chunk's ``tool_calls`` deltas that carry an ``id`` open
    a call: they are counted."""
    usage = event.get("usage")
    if usage is None:
        raise ValueError(
            "a chunk without usage: "
            "the server does not honour stream_options.continuous_usage_stats"
        )
    if not event["choices"]:
        res.completion_tokens = int(usage["completion_tokens"])
        return 0
    for choice in event["choices"]:
        res.tool_calls += sum(
            "id" in call for call in (choice.get("delta") or {}).get("tool_calls") or ()
        )
    return int(usage["completion_tokens"]) - res.tokens


def whole_response_tokens(api: str, data: dict[str, Any], res: ReqResult) -> None:
    """A non-streaming answer's tokens. /v1/completions and chat give only their usage count
    (the text is not countable in tokens), so nothing can be lost there by this measure."""
    if api in USAGE_COUNTED:
        res.tokens = res.completion_tokens = int(data["usage"]["completion_tokens"])
        res.tool_calls = sum(
            len((c.get("message") or {}).get("tool_calls") or ()) for c in data["choices"]
        )
        return
    res.tokens = len(data["output_ids"])
    res.completion_tokens = data["meta_info"]["completion_tokens"]
    if res.logprobs is not None:
        res.logprobs = len(data["meta_info"].get("output_token_logprobs") or ())


async def send_one(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    t0: float,
    on_headers: Callable[[], None] | None = None,
    api: str = "generate",
) -> ReqResult:
    """One request to ``api``'s endpoint. ``on_headers`` is called when a stream's headers
    arrive: the server has then already handed the request to the scheduler."""
    res = ReqResult(stream=bool(body["stream"]), logprobs=0 if body.get("return_logprob") else None)
    endpoint = f"{url}{ENDPOINTS[api]}"
    event_tokens = usage_event_tokens if api in USAGE_COUNTED else generate_event_tokens
    start = time.perf_counter()
    res.sent = start - t0
    try:
        if not res.stream:
            resp = await client.post(endpoint, json=body)
            now = time.perf_counter()
            res.status = resp.status_code
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return res
            whole_response_tokens(api, resp.json(), res)
            res.ttft = res.e2e = now - start
            res.arrivals.append((now - t0, res.tokens))
            res.ok = True
            return res
        async with client.stream("POST", endpoint, json=body) as resp:
            res.status = resp.status_code
            if on_headers is not None:
                on_headers()
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            last = start
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                payload = line[6:]
                if payload == "[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    res.error = f"stream error: {event['error'].get('message')}"
                    return res
                n = event_tokens(event, res)
                if n == 0:
                    continue
                if res.ttft is None:
                    res.ttft = now - start
                else:
                    res.itl.append((now - last) / n)
                last = now
                res.tokens += n
                res.arrivals.append((now - t0, n))
            res.e2e = time.perf_counter() - start
            if not done:
                res.error = "stream ended without [DONE]"
                return res
            if api in USAGE_COUNTED and res.completion_tokens is None:
                res.error = "stream ended without its usage chunk"
                return res
            res.ok = True
    except Exception as exc:  # noqa: BLE001 - every failure is a counted error
        res.error = f"{type(exc).__name__}: {exc}"
    return res
