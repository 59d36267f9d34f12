"""The fields and endpoints SGLang's and vLLM's users always have: ``prompt_logprobs`` (null)
on completion choices and chat responses, SGLang's ``matched_stop``, ``root`` on model cards,
``token_strs`` from ``/tokenize``, ``max_total_num_tokens`` and ``version`` in
``/server_info``, ``/version``, SGLang's ``/v1/tokenize`` and ``/v1/detokenize``, vLLM's
``/load``, ``/tokenizer_info`` and ``/invocations``. Against the shared server, with the
official openai client where the field is typed there; ``/tokenizer_info``'s answer (behind
its flag) in-process."""

from __future__ import annotations

import time
import importlib.metadata
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import openai
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pipeline.config import ServerConfig
from pipeline.tokenizer_loader import DEFAULT_TOKENIZER_DIR, load_tokenizer
from tests.server_harness import ServerProcess
from tokenizer_proc.http.hot_routes import Endpoint
from tokenizer_proc.http.peer_api import INVOCATION_ROUTES, build_peer_router
from tokenizer_proc.tokenizer_manager import TokenizerManager

TOKENIZER = load_tokenizer(None)
MODEL = "tokenpipe-tiny"
PROMPT = "The quick brown fox jumps over the lazy dog, and then"
[EOS] = sorted(TOKENIZER.eos_token_ids)
GREEDY: dict[str, Any] = {"temperature": 0}
VERSION = importlib.metadata.version("tokenpipe")


def _forced(token: int, **extra: Any) -> dict[str, Any]:
    """Sampling that makes ``token`` the first output token."""
    return {"extra_body": {**extra}, "logit_bias": {str(token): 100}, **GREEDY}


def test_prompt_logprobs_is_null_on_completion_choices_and_chat_responses(
    oai: openai.OpenAI, http: httpx.Client
) -> None:
    completion = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert (
        completion.choices[0].model_extra is not None
        and completion.choices[0].model_extra["prompt_logprobs"] is None
    )
    chat = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert chat.model_extra is not None and chat.model_extra["prompt_logprobs"] is None
    # Exactly where the peers put them: on a completion's choices, on a chat's response.
    raw = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).json()
    assert list(raw["choices"][0]) == [
        "index",
        "text",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "matched_stop",
        "token_ids",
        "prompt_logprobs",
        "prompt_token_ids",
        "routed_experts",
    ]
    raw_chat = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    ).json()
    assert list(raw_chat) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "usage",
        "prompt_logprobs",
        "prompt_token_ids",
        "prompt_text",
        "service_tier",
        "system_fingerprint",
        "kv_transfer_params",
        "ec_transfer_params",
        "metrics",
        "metadata",
    ]
    assert raw_chat["prompt_logprobs"] is None and "prompt_logprobs" not in raw_chat["choices"][0]


def test_matched_stop_names_the_stop_string_token_or_eos_and_is_null_on_length(
    oai: openai.OpenAI,
) -> None:
    full = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, extra_body={"ignore_eos": True}, **GREEDY
    ).choices[0]
    assert (
        full.finish_reason == "length"
        and full.model_extra is not None
        and full.model_extra["matched_stop"] is None
    )
    word = full.text.split()[2]
    stopped = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=12,
        stop=[word],
        extra_body={"ignore_eos": True},
        **GREEDY,
    ).choices[0]
    assert (
        stopped.finish_reason == "stop"
        and stopped.model_extra is not None
        and stopped.model_extra["matched_stop"] == word
    )

    token = 5  # not an EOS id: a stop token only because the request names it
    assert token not in TOKENIZER.eos_token_ids
    named = oai.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, **_forced(token, stop_token_ids=[token])
    ).choices[0]
    assert named.finish_reason == "stop" and named.model_extra is not None
    assert named.model_extra["matched_stop"] == token and named.model_extra["stop_reason"] == token

    # EOS: SGLang names its id, where vLLM's stop_reason stays null.
    messages: Any = [{"role": "user", "content": PROMPT}]
    eos = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, **_forced(EOS)
    ).choices[0]
    assert eos.finish_reason == "stop" and eos.model_extra is not None
    assert eos.model_extra["matched_stop"] == EOS and eos.model_extra["stop_reason"] is None

    # Streamed: on every chunk, as SGLang's, its value on the finishing chunk only.
    for stream in (
        oai.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            stop=[word],
            stream=True,
            extra_body={"ignore_eos": True},
            **GREEDY,
        ),
        oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, stream=True, **_forced(EOS)
        ),
    ):
        choices = [chunk.choices[0] for chunk in stream if chunk.choices]
        assert all((c.model_extra or {})["matched_stop"] is None for c in choices[:-1])
        assert choices[-1].finish_reason == "stop" and (choices[-1].model_extra or {})[
            "matched_stop"
        ] in (word, EOS)


def test_model_card_has_root_and_tokenize_has_token_strs(
    oai: openai.OpenAI, http: httpx.Client
) -> None:
    card = http.get(f"/v1/models/{MODEL}").json()
    # Anthropic's ModelInfo keys beside OpenAI's (tests/e2e/test_anthropic_edge.py reads them).
    anthropic_keys = {
        "type": "model", "display_name": MODEL, "created_at": card["created_at"],
        "max_input_tokens": card["max_model_len"], "lifecycle": "active",
    }  # fmt: skip
    assert card == {
        "id": MODEL, "object": "model", "created": card["created"], "owned_by": "tokenpipe",
        "root": str(DEFAULT_TOKENIZER_DIR), "parent": None, "max_model_len": card["max_model_len"],
        **anthropic_keys,
    }  # fmt: skip
    assert datetime.fromisoformat(card["created_at"]).timestamp() == card["created"]
    assert oai.models.retrieve(MODEL).model_extra == {
        "root": str(DEFAULT_TOKENIZER_DIR),
        "parent": None,  # vLLM's: an adapter's card names its base here
        "max_model_len": card["max_model_len"],
        **anthropic_keys,
    }
    assert http.get("/v1/models").json()["data"] == [card]

    ids = TOKENIZER.encode("hi there", add_special_tokens=True)
    strs = [TOKENIZER.tokenizer.id_to_token(i) for i in ids]
    plain = http.post("/tokenize", json={"prompt": "hi there"}).json()
    assert plain == {
        "count": len(ids),
        "max_model_len": card["max_model_len"],
        "tokens": ids,
        "token_strs": None,
    }
    assert http.post(
        "/tokenize", json={"prompt": "hi there", "return_token_strs": True}
    ).json() == {**plain, "token_strs": strs}


def test_server_info_has_the_kv_pool_size_and_version_and_version_route(http: httpx.Client) -> None:
    info = http.get("/server_info").json()
    assert (
        info["max_total_num_tokens"] == info["max_total_tokens"] == 8192
    )  # SMALL_SERVER_ARGS' pool
    assert (
        info["scheduler"] is None
        or info["scheduler"]["kv_capacity"] == info["max_total_num_tokens"]
    )
    assert info["version"] == VERSION
    assert http.get("/version").json() == {"version": VERSION}


def test_v1_tokenize_and_detokenize_take_both_peers_requests(http: httpx.Client) -> None:
    context = http.get("/server_info").json()["context_length"]
    texts = ["hello world", "a"]
    batch = [TOKENIZER.encode(t, add_special_tokens=True) for t in texts]
    for path in ("/v1/tokenize", "/tokenize"):
        # SGLang's list of prompts: one entry per prompt in each key.
        listed = http.post(path, json={"prompt": texts, "add_special_tokens": True}).json()
        assert listed == {
            "count": [len(ids) for ids in batch],
            "max_model_len": context,
            "tokens": batch,
            "token_strs": None,
        }
        with_strs = http.post(path, json={"prompt": texts, "return_token_strs": True}).json()[
            "token_strs"
        ]
        assert with_strs == [[TOKENIZER.tokenizer.id_to_token(i) for i in ids] for ids in batch]
        assert http.post(path, json={"prompt": texts[0]}).json()["tokens"] == batch[0]

    special = [EOS, *batch[0], EOS]
    shown = TOKENIZER.decode(special, skip_special_tokens=False)
    skipped = TOKENIZER.decode(special, skip_special_tokens=True)
    assert shown != skipped
    # Both keys answer; each path keeps its peer's default for special tokens.
    assert http.post("/v1/detokenize", json={"tokens": special}).json() == {
        "prompt": skipped,
        "text": skipped,
    }
    assert http.post("/detokenize", json={"tokens": special}).json() == {
        "prompt": shown,
        "text": shown,
    }
    for path in ("/v1/detokenize", "/detokenize"):
        assert (
            http.post(path, json={"tokens": special, "skip_special_tokens": False}).json()["text"]
            == shown
        )
        assert (
            http.post(path, json={"tokens": special, "skip_special_tokens": True}).json()["text"]
            == skipped
        )
        # SGLang's lists of ids round-trip a tokenized batch.
        round_trip = http.post(path, json={"tokens": batch, "skip_special_tokens": True}).json()
        assert round_trip == {"prompt": texts, "text": texts}
        assert http.post(path, json={"tokens": []}).json() == {"prompt": "", "text": ""}
        mixed = http.post(path, json={"tokens": [1, [2]]})
        assert mixed.status_code == 400 and mixed.json()["error"]["param"] == "tokens"
        too_big = http.post(path, json={"tokens": [[1], [TOKENIZER.vocab_size]]})
        assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "tokens[1][0]"


def test_load_counts_requests_in_flight(server: ServerProcess, http: httpx.Client) -> None:
    # An earlier test's cut stream stays live in the API until its abort comes back: wait.
    deadline = time.monotonic() + 30
    while http.get("/load").json() != {"server_load": 0} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert http.get("/load").json() == {"server_load": 0}
    body = {
        "text": "hi",
        "rid": "load-probe",
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
        "stream": True,
    }
    with (
        httpx.Client(base_url=server.url, timeout=60) as other,
        other.stream("POST", "/generate", json=body) as stream,
    ):
        assert stream.status_code == 200
        # Held, not dropped: a dropped iterator closes the stream, and the server then
        # aborts the request as a disconnect, racing what the test checks.
        lines = stream.iter_lines()
        next(lines)  # the request is running
        load = http.get("/load").json()
        # Stop it if it still runs: with a fast forward its 2000 tokens may already be done,
        # so the abort's answer proves nothing. The load of 1 does: nothing else was live.
        http.post("/abort_request", json={"rid": "load-probe"})
    assert load == {"server_load": 1}


def test_invocations_answer_as_the_route_the_body_names(http: httpx.Client) -> None:
    # Greedy: the second of each pair finds its prompt in the prefix cache, and a sampled
    # near-tie could go the other way on the recomputed last position.
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
    completion = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    for body, path in ((chat, "/v1/chat/completions"), (completion, "/v1/completions")):
        direct, invoked = (
            http.post(path, json=body).json(),
            http.post("/invocations", json=body).json(),
        )
        assert invoked["object"] == direct["object"]
        assert invoked["choices"] == direct["choices"] and invoked["usage"] == direct["usage"]
    # The chosen route's own refusal; a body naming no route gets 400.
    refused = http.post("/invocations", json={"prompt": PROMPT, "max_tokens": -1})
    assert (
        refused.status_code == 400
        and refused.json()
        == http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": -1}).json()
    )
    for bad in ({"text": "hi"}, [1, 2]):
        answer = http.post("/invocations", json=bad)
        assert answer.status_code == 400 and answer.json()["error"]["message"].startswith(
            "Cannot find suitable handler for request."
        )
    assert http.post("/invocations", content=b"{").status_code == 400


def test_tokenizer_info_is_served_only_behind_its_flag(http: httpx.Client, tmp_path: Path) -> None:
    assert http.get("/tokenizer_info").status_code == 404  # the shared server runs without the flag

    async def unused(_: object) -> Any:
        raise AssertionError("not called")

    endpoints: dict[str, Endpoint] = {path: unused for _, path in INVOCATION_ROUTES}
    config = ServerConfig(
        scheduler_input=f"ipc://{tmp_path}/sched",
        tokenizer_input=f"ipc://{tmp_path}/tm",
        enable_tokenizer_info_endpoint=True,
    )
    app = FastAPI()
    app.include_router(
        build_peer_router(TokenizerManager(config, TOKENIZER, context_length=2048), endpoints)
    )
    with TestClient(app) as client:
        info = client.get("/tokenizer_info").json()
    on_disk = json.loads(
        (DEFAULT_TOKENIZER_DIR / "tokenizer_config.json").read_text(encoding="utf-8")
    )
    assert info == {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **on_disk,
        "chat_template": TOKENIZER.chat_template,
    }
