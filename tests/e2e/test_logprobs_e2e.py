"""/generate logprobs against Hugging Face transformers on a checkpoint the test writes:
the chosen token's, the top ones and those of asked ids are transformers' log-softmax of
the logits that predicted each token (within 1e-4), greedy and sampled, streamed (each
event's entries are those of every token so far, the last event's the whole answer's) and
not, on a unified server and through a PD prefill/decode pair."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from tokenizers import Tokenizer

from bench.small_checkpoint import write
from tests.server_harness import ServerProcess, free_port

PROMPT = "The quick brown fox jumps over"
TOP = 3
ASKED_IDS = [5, 77, 1000]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("logprob-ckpt")
    write(directory, layers=2, hidden=64, seed=11)
    return directory


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path):  # type: ignore[no-untyped-def]
    if importlib.util.find_spec("transformers") is None:
        message = "transformers is not installed (make test installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(message + "; CI=true: a missing reference is a failure")
        pytest.skip(message)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        tmp_path_factory.mktemp("logprob-server") / "tmp", ["--model-path", str(checkpoint)]
    ).wait_ready()
    yield srv
    srv.stop()


def reference(  # type: ignore[no-untyped-def]
    hf_model, prompt_ids: list[int], output_ids: list[int]
) -> torch.Tensor:
    """transformers' log-softmax of the logits that predicted each output token."""
    ids = torch.tensor([prompt_ids + output_ids[:-1]])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(prompt_ids) - 1 :]
    return torch.log_softmax(logits.float(), dim=-1)


def body(sampling: dict[str, object], stream: bool) -> dict[str, object]:
    return {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 12, "ignore_eos": True, **sampling},
        "stream": stream,
        "return_logprob": True,
        "top_logprobs_num": TOP,
        "token_ids_logprob": ASKED_IDS,
        "return_text_in_logprobs": True,
    }


def streamed(
    server: ServerProcess, payload: dict[str, object]
) -> tuple[list[int], dict[str, list[object]]]:
    """The last event's ids and output logprob keys (each event holds everything so far,
    SGLang's default stream), after checking that every event's entries are its ids'."""
    keys = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")
    events = []
    with httpx.stream("POST", server.url + "/generate", json=payload, timeout=60) as resp:
        assert resp.status_code == 200
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    for event in events:
        for key in keys:
            assert len(event["meta_info"][key]) == len(event["output_ids"]), (
                "an event's entries are those of its ids"
            )
    return events[-1]["output_ids"], {key: events[-1]["meta_info"][key] for key in keys}


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.9, "seed": 7}],
    ids=["greedy", "sampled"],
)
def test_generate_logprobs_equal_transformers(
    server: ServerProcess, hf_model, checkpoint: Path, sampling: dict[str, object]
) -> None:  # type: ignore[no-untyped-def]
    whole = httpx.post(
        server.url + "/generate", json=body(sampling, stream=False), timeout=60
    ).json()
    meta = whole["meta_info"]
    out = whole["output_ids"]
    prompt_ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()[
        "tokens"
    ]
    ref = reference(hf_model, prompt_ids, out)
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    assert len(meta["output_token_logprobs"]) == len(out) == 12
    for j, (lp, token, text) in enumerate(meta["output_token_logprobs"]):
        assert token == out[j] and text == tokenizer.decode([token], skip_special_tokens=False)
        assert all(
            e[2] == tokenizer.decode([e[1]], skip_special_tokens=False)
            for e in meta["output_top_logprobs"][j]
        )
        assert lp == pytest.approx(float(ref[j, token]), abs=1e-4)
        values, top_ids = ref[j].topk(TOP)
        assert [e[1] for e in meta["output_top_logprobs"][j]] == top_ids.tolist()
        assert [e[0] for e in meta["output_top_logprobs"][j]] == pytest.approx(
            values.tolist(), abs=1e-4
        )
        assert [e[1] for e in meta["output_token_ids_logprobs"][j]] == ASKED_IDS
        assert [e[0] for e in meta["output_token_ids_logprobs"][j]] == pytest.approx(
            [float(ref[j, t]) for t in ASKED_IDS], abs=1e-4
        )
    if sampling.get("temperature"):
        assert any(
            e[1] != t[0][1]
            for e, t in zip(meta["output_token_logprobs"], meta["output_top_logprobs"])
        ), "sampling never left the top token"
    ids, joined = streamed(server, body(sampling, stream=True))
    assert ids == out
    # Equal up to float rounding: the two requests ran in different batches.
    assert [e[1:] for e in joined["output_token_logprobs"]] == [
        e[1:] for e in meta["output_token_logprobs"]
    ]
    assert [e[0] for e in joined["output_token_logprobs"]] == pytest.approx(
        [e[0] for e in meta["output_token_logprobs"]], abs=1e-5
    )
    for key in ("output_top_logprobs", "output_token_ids_logprobs"):
        assert [[e[1:] for e in pos] for pos in joined[key]] == [
            [e[1:] for e in pos] for pos in meta[key]
        ], key
        flat = [e[0] for pos in joined[key] for e in pos]
        assert flat == pytest.approx([e[0] for pos in meta[key] for e in pos], abs=1e-5), key


def test_logprob_fields_are_checked(server: ServerProcess) -> None:
    def post(extra: dict[str, object]) -> httpx.Response:
        return httpx.post(
            server.url + "/generate",
            json={"text": "a", "sampling_params": {"max_new_tokens": 2}, **extra},
            timeout=30,
        )

    for extra, param in (
        ({"return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
        ({"return_logprob": True, "token_ids_logprob": [10**6]}, "token_ids_logprob"),
        ({"return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    ):
        r = post(extra)
        assert r.status_code == 400 and param in r.json()["error"]["message"], (extra, r.text)
    plain = post({"return_logprob": False, "top_logprobs_num": 5}).json()["meta_info"]
    assert "output_token_logprobs" not in plain


def test_openai_completions_logprobs_equal_transformers(  # type: ignore[no-untyped-def]
    server: ServerProcess, hf_model
) -> None:
    """The official client reads OpenAI's completions shape: tokens, token_logprobs, the
    top ones (N plus the chosen token) and text offsets into the text."""
    with server.openai_client() as client:
        model = client.models.list().data[0].id
        out = client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            logprobs=2,
            extra_body={"ignore_eos": True},
        )
        streamed_chunks = list(
            client.completions.create(
                model=model,
                prompt=PROMPT,
                max_tokens=8,
                temperature=0,
                logprobs=2,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        )
    choice = out.choices[0]
    lp = choice.logprobs
    assert (
        lp is not None
        and len(lp.tokens)
        == len(lp.token_logprobs)
        == len(lp.top_logprobs)
        == len(lp.text_offset)
        == 8
    )
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    prompt_ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()[
        "tokens"
    ]
    generated = httpx.post(
        server.url + "/generate",
        json=body({"temperature": 0}, stream=False)
        | {"sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0}},
        timeout=60,
    ).json()["output_ids"]
    ref = reference(hf_model, prompt_ids, generated)
    for j, token in enumerate(generated):
        assert lp.token_logprobs[j] == pytest.approx(float(ref[j, token]), abs=1e-4)
        top = lp.top_logprobs[j]
        assert lp.tokens[j] in top and 2 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(float(ref[j].max()), abs=1e-4)
    chunked = [
        c.choices[0].logprobs
        for c in streamed_chunks
        if c.choices and c.choices[0].logprobs is not None
    ]
    assert [t for c in chunked for t in c.tokens] == lp.tokens
    assert [o for c in chunked for o in c.text_offset] == lp.text_offset
    assert [v for c in chunked for v in c.token_logprobs] == pytest.approx(
        lp.token_logprobs, abs=1e-5
    )


def test_openai_chat_logprobs(server: ServerProcess) -> None:
    """Chat's shape: content entries of token, logprob, bytes and top_logprobs; greedy, so
    the chosen token is the most likely one; the same values as a completion of the same
    templated prompt."""
    messages = [{"role": "user", "content": "Say something"}]
    with server.openai_client() as client:
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=6,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            extra_body={"ignore_eos": True},  # type: ignore[arg-type]
        )
        prompt_ids = httpx.post(
            server.url + "/tokenize", json={"messages": messages}, timeout=30
        ).json()["tokens"]
        same = client.completions.create(
            model=model,
            prompt=prompt_ids,
            max_tokens=6,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
        chunks = list(
            client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=6,
                temperature=0,
                logprobs=True,
                top_logprobs=2,
                stream=True,  # type: ignore[arg-type]
                extra_body={"ignore_eos": True},
            )
        )
        bad = httpx.post(
            server.url + "/v1/chat/completions",
            json={"messages": messages, "top_logprobs": 2},
            timeout=30,
        )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs is not None
        for e in c.choices[0].logprobs.content or []
    ]
    assert [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in content or []
    ]
    assert [e.logprob for e in streamed] == pytest.approx(
        [e.logprob for e in content or []], abs=1e-5
    )
    assert content is not None and len(content) == 6
    joined = bytes(b for entry in content for b in entry.bytes or []).decode(
        "utf-8", errors="replace"
    )
    assert joined.rstrip("\ufffd") == (chat.choices[0].message.content or "").rstrip("\ufffd"), (
        "the bytes spell the text"
    )
    for entry in content:
        assert bytes(entry.bytes or []).decode("utf-8", errors="replace") == entry.token
        assert (
            len(entry.top_logprobs) == 2
            and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        )
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6)
    assert [e.logprob for e in content] == pytest.approx(
        same.choices[0].logprobs.token_logprobs, abs=1e-5
    )  # type: ignore[union-attr]
    assert bad.status_code == 400 and "top_logprobs" in bad.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_scores_the_prompt_with_max_tokens_0(
    server: ServerProcess, hf_model, stream: bool
) -> None:  # type: ignore[no-untyped-def]
    """``echo`` with ``max_tokens`` 0 (OpenAI's legacy scoring): the prompt comes back as the
    text with a logprob per prompt token (the first null) and its top ones, no completion;
    ``max_tokens`` 0 without echo is refused."""
    prompt_ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()[
        "tokens"
    ]
    ref = prompt_reference(hf_model, prompt_ids)
    with server.openai_client() as client:
        model = client.models.list().data[0].id
        if stream:
            chunks = list(
                client.completions.create(
                    model=model, prompt=prompt_ids, max_tokens=0, echo=True, logprobs=2, stream=True
                )
            )
            choices = [c.choices[0] for c in chunks if c.choices]
            text = "".join(c.text for c in choices)
            tokens = [t for c in choices if c.logprobs is not None for t in c.logprobs.tokens]
            values = [
                v for c in choices if c.logprobs is not None for v in c.logprobs.token_logprobs
            ]
            finish = choices[-1].finish_reason
        else:
            out = client.completions.create(
                model=model, prompt=prompt_ids, max_tokens=0, echo=True, logprobs=2
            )
            lp = out.choices[0].logprobs
            assert lp is not None and out.usage is not None and out.usage.completion_tokens == 0
            text, tokens, values, finish = (
                out.choices[0].text,
                lp.tokens,
                lp.token_logprobs,
                out.choices[0].finish_reason,
            )
            assert lp.top_logprobs[0] is None and all(2 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    assert finish == "length"
    assert text == "".join(tokens) and len(tokens) == len(prompt_ids)
    assert values[0] is None
    assert values[1:] == pytest.approx(
        [float(ref[q - 1, t]) for q, t in enumerate(prompt_ids) if q], abs=1e-4
    )
    refused = httpx.post(
        server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 0}, timeout=30
    )
    assert refused.status_code == 400 and "max_tokens" in refused.json()["error"]["message"]


def test_each_choice_has_its_own_logprobs(  # type: ignore[no-untyped-def]
    server: ServerProcess, hf_model
) -> None:
    """``n`` > 1 with sampling: each choice's logprobs are those of its own tokens. Choice i
    draws with seed + i, so /generate with that seed gives its token ids."""
    prompt_ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()[
        "tokens"
    ]
    with server.openai_client() as client:
        model = client.models.list().data[0].id
        out = client.completions.create(
            model=model,
            prompt=prompt_ids,
            max_tokens=5,
            n=3,
            temperature=1.0,
            seed=5,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
    drawn = []
    for choice in out.choices:
        sampling = {
            "max_new_tokens": 5,
            "ignore_eos": True,
            "temperature": 1.0,
            "seed": 5 + choice.index,
        }
        ids = httpx.post(
            server.url + "/generate",
            json={"input_ids": prompt_ids, "sampling_params": sampling},
            timeout=60,
        ).json()["output_ids"]
        ref = reference(hf_model, prompt_ids, ids)
        lp = choice.logprobs
        assert lp is not None and lp.token_logprobs == pytest.approx(
            [float(ref[j, t]) for j, t in enumerate(ids)], abs=1e-4
        )
        drawn.append(tuple(ids))
    assert len(set(drawn)) > 1, "the seeded choices all drew the same tokens"


def prompt_reference(  # type: ignore[no-untyped-def]
    hf_model, prompt_ids: list[int]
) -> torch.Tensor:
    """Row q - 1: transformers' log-softmax of the logits that predict prompt token q."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_prompt_entries(
    meta: dict[str, Any], prompt_ids: list[int], start: int, ref: torch.Tensor
) -> None:
    """``meta_info``'s input_* keys from ``start`` on equal ``ref`` (``prompt_reference``):
    position 0 null, then each position's logprob, top ids and asked ids' logprobs."""
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt_ids[start:]
    for q, (lp, token, _) in zip(range(start, len(prompt_ids)), entries):
        if q == 0:
            assert lp is None and meta["input_top_logprobs"][0] is None
            continue
        assert lp == pytest.approx(float(ref[q - 1, token]), abs=1e-4), q
        assert [e[1] for e in meta["input_top_logprobs"][q - start]] == ref[q - 1].topk(
            TOP
        ).indices.tolist()
        assert [e[0] for e in meta["input_token_ids_logprobs"][q - start]] == pytest.approx(
            [float(ref[q - 1, t]) for t in ASKED_IDS], abs=1e-4
        )


def rank_band(row: torch.Tensor, token: int, tol: float = 1e-4) -> tuple[int, int]:
    """The rank transformers' log-softmax ``row`` gives ``token`` by vLLM's rule (the values
    at or above its own, itself included), as the range a server's may take: values within
    ``tol`` of its own (the tolerance the values are held to) may fall on either side."""
    own = row[token]
    return int((row > own + tol).sum()) + 1, int((row >= own - tol).sum())


def completion_and_chat(
    server: ServerProcess, text: str, asked: dict[str, Any]
) -> list[tuple[dict[str, Any] | None, str]]:
    """One token of ``text`` as a completion prompt and as a chat user message, with vLLM's
    extra fields ``asked``: each answer's extra fields (choice for a completion, response
    for chat) and which it is."""
    with server.openai_client() as client:
        model = client.models.list().data[0].id
        out = client.completions.create(model=model, prompt=text, max_tokens=1, extra_body=asked)
        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": text}],
            max_tokens=1,
            extra_body=asked,
        )  # type: ignore[list-item]
    return [(out.choices[0].model_extra, "completion"), (chat.model_extra, "chat")]


def test_openai_prompt_logprobs_equal_transformers(  # type: ignore[no-untyped-def]
    server: ServerProcess, hf_model
) -> None:
    """vLLM's ``prompt_logprobs`` (on a completion choice, at a chat response's top level):
    each position's prompt token and its ``TOP`` most likely ones are transformers'
    log-softmax of the logits before it (within 1e-4), ranked 1..TOP; the prompt token's rank
    is its place among them, and outside them its rank in transformers' distribution."""
    asked = {"prompt_logprobs": TOP, "return_token_ids": True}
    for fields, where in completion_and_chat(server, PROMPT, asked):
        assert fields is not None
        entries, prompt_ids = fields["prompt_logprobs"], fields["prompt_token_ids"]
        ref = prompt_reference(hf_model, prompt_ids)
        assert entries[0] is None and len(entries) == len(prompt_ids), where
        for q in range(1, len(prompt_ids)):
            token, entry, row = prompt_ids[q], entries[q], ref[q - 1]
            assert entry[str(token)]["logprob"] == pytest.approx(float(row[token]), abs=1e-4), (
                where,
                q,
            )
            top_ids = row.topk(TOP).indices.tolist()
            ranked = sorted(
                (v["rank"], int(k), v["logprob"]) for k, v in entry.items() if v["rank"] <= TOP
            )
            assert [(r, t) for r, t, _ in ranked] == list(enumerate(top_ids, 1)), (where, q)
            assert [lp for _, _, lp in ranked] == pytest.approx(
                [float(row[t]) for t in top_ids], abs=1e-4
            ), (where, q)
            low, high = rank_band(row, token)
            assert low <= entry[str(token)]["rank"] <= high, (where, q)


def test_prompt_logprob_ranks_equal_transformers(  # type: ignore[no-untyped-def]
    server: ServerProcess, hf_model
) -> None:
    """Every prompt token's ``rank`` is a number, the count transformers' distribution gives
    it (``rank_band``), with no top entries asked (``prompt_logprobs`` 0: the rank comes from
    the scheduler's rank column alone), through completions and chat."""
    asked = {"prompt_logprobs": 0, "return_token_ids": True}
    text = PROMPT + " the lazy dog. A stitch in time saves nine; all that glitters is not gold."
    for fields, where in completion_and_chat(server, text, asked):
        assert fields is not None
        entries, prompt_ids = fields["prompt_logprobs"], fields["prompt_token_ids"]
        ref = prompt_reference(hf_model, prompt_ids)
        ranks = []
        for q in range(1, len(prompt_ids)):
            token = prompt_ids[q]
            assert list(entries[q]) == [str(token)], (where, q)
            low, high = rank_band(ref[q - 1], token)
            ranks.append(entries[q][str(token)]["rank"])
            assert low <= ranks[-1] <= high, (where, q, ranks[-1], low, high)
        assert len(ranks) > 30 and max(ranks) > 100, "the prompt's tokens are ranked deep"


@pytest.fixture(scope="module")
def chunked_server(
    checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = ["--model-path", str(checkpoint), "--chunked-prefill-size", "3"]
    srv = ServerProcess(tmp_path_factory.mktemp("logprob-chunked") / "tmp", args).wait_ready()
    yield srv
    srv.stop()


@pytest.mark.parametrize("start", [0, 3])
@pytest.mark.parametrize("which", ["whole", "chunked"])
def test_prompt_logprobs_equal_transformers(
    server: ServerProcess, chunked_server: ServerProcess, hf_model, start: int, which: str
) -> None:  # type: ignore[no-untyped-def]
    """From logprob_start_len on, each prompt position's logprob (null at position 0), top
    and asked ids; prefilled at once or in chunks of 3, and again once the prompt is in the
    prefix cache (the positions prompt logprobs need are computed, not taken from it)."""
    srv = server if which == "whole" else chunked_server
    payload = body({"temperature": 0}, stream=False) | {"logprob_start_len": start}
    prompt_ids = httpx.post(srv.url + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()[
        "tokens"
    ]
    ref = prompt_reference(hf_model, prompt_ids)
    for _ in range(2):  # the second finds the prompt cached
        meta = httpx.post(srv.url + "/generate", json=payload, timeout=60).json()["meta_info"]
        assert_prompt_entries(meta, prompt_ids, start, ref)
    streamed_meta = []
    with httpx.stream(
        "POST", srv.url + "/generate", json=payload | {"stream": True}, timeout=60
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                streamed_meta.append(json.loads(line[6:])["meta_info"])
    # Each event is the whole answer so far: every one lists the prompt's, as SGLang's do.
    assert all(
        [e[1] for e in m["input_token_logprobs"]] == prompt_ids[start:] for m in streamed_meta
    )


@pytest.fixture(scope="module")
def pd_pair(
    checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, ServerProcess, int]]:
    """A prefill and a decode server on the checkpoint, and the prefill side's KV port."""
    base = tmp_path_factory.mktemp("logprob-pd")
    port = free_port()
    model = ["--model-path", str(checkpoint)]
    prefill = ServerProcess(
        base / "prefill" / "tmp",
        [*model, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port)],
    )
    decode = ServerProcess(base / "decode" / "tmp", [*model, "--disaggregation-mode", "decode"])
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield prefill, decode, port
    finally:
        prefill.stop()
        decode.stop()


def pd_generate(
    pair: tuple[ServerProcess, ServerProcess, int], payload: dict[str, object], room: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One request through the pair as sglang-router sends it (the same body to both, with
    the bootstrap fields): the prefill server's answer, and the decode server's answer (one
    item) or stream events."""
    prefill, decode, port = pair
    bootstrapped = payload | {
        "bootstrap_room": room,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": port,
    }

    def decode_side() -> list[dict[str, Any]]:
        if not payload["stream"]:
            response = httpx.post(decode.url + "/generate", json=bootstrapped, timeout=60)
            assert response.status_code == 200, response.text
            return [response.json()]
        with httpx.stream("POST", decode.url + "/generate", json=bootstrapped, timeout=60) as resp:
            assert resp.status_code == 200, resp.read()
            return [
                json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")
            ]

    with ThreadPoolExecutor(1) as pool:
        decoded = pool.submit(decode_side)
        first = httpx.post(
            prefill.url + "/generate", json=bootstrapped | {"stream": False}, timeout=60
        )
        assert first.status_code == 200, first.text
        return first.json(), decoded.result()


@pytest.mark.parametrize(
    ("sampling", "start"),
    [({"temperature": 0}, 0), ({"temperature": 0.9, "top_p": 0.9, "seed": 7}, 3)],
    ids=["greedy", "sampled"],
)
def test_pd_logprobs_equal_transformers(
    pd_pair: tuple[ServerProcess, ServerProcess, int],
    hf_model,
    sampling: dict[str, object],
    start: int,
) -> None:  # type: ignore[no-untyped-def]
    """Through PD the prefill server computes the prompt's and the first token's logprobs
    and sends them with the KV; the decode server's answer lists every entry, equal to
    transformers' (the prefill server's own answer lists the first token's only: see
    ``RequestChecks.answered_logprobs``). Streamed, each event lists the prompt's and
    those of every token so far."""
    prefill_answer, (whole,) = pd_generate(
        pd_pair, body(sampling, stream=False) | {"logprob_start_len": start}, room=501 + start
    )
    meta, out = whole["meta_info"], whole["output_ids"]
    prompt_ids = httpx.post(
        pd_pair[1].url + "/tokenize", json={"prompt": PROMPT}, timeout=30
    ).json()["tokens"]
    ref = reference(hf_model, prompt_ids, out)
    assert (
        len(meta["output_token_logprobs"]) == len(out) == 12
        and out[0] == prefill_answer["output_ids"][0]
    )
    for j, (lp, token, _) in enumerate(meta["output_token_logprobs"]):
        assert token == out[j] and lp == pytest.approx(float(ref[j, token]), abs=1e-4), j
        values, top_ids = ref[j].topk(TOP)
        assert [e[1] for e in meta["output_top_logprobs"][j]] == top_ids.tolist()
        assert [e[0] for e in meta["output_top_logprobs"][j]] == pytest.approx(
            values.tolist(), abs=1e-4
        )
        assert [e[0] for e in meta["output_token_ids_logprobs"][j]] == pytest.approx(
            [float(ref[j, t]) for t in ASKED_IDS], abs=1e-4
        )
    if sampling.get("temperature"):
        assert any(
            e[1] != t[0][1]
            for e, t in zip(meta["output_token_logprobs"], meta["output_top_logprobs"])
        ), "sampling never left the top token"
    assert_prompt_entries(meta, prompt_ids, start, prompt_reference(hf_model, prompt_ids))
    first = prefill_answer["meta_info"]
    assert len(first["output_token_logprobs"]) == 1 and "input_token_logprobs" not in first

    _, events = pd_generate(
        pd_pair, body(sampling, stream=True) | {"logprob_start_len": start}, room=601 + start
    )
    assert events[-1]["output_ids"] == out
    for e in events:
        assert [entry[1] for entry in e["meta_info"]["input_token_logprobs"]] == prompt_ids[start:]
        assert [entry[1] for entry in e["meta_info"]["output_token_logprobs"]] == e["output_ids"], (
            "an event's entries are its ids'"
        )
    final = events[-1]["meta_info"]["output_token_logprobs"]
    assert [e[0] for e in final] == pytest.approx(
        [e[0] for e in meta["output_token_logprobs"]], abs=1e-5
    )


def test_max_new_tokens_0_scores_the_prompt_on_generate(server: ServerProcess) -> None:
    """SGLang's scoring: ``max_new_tokens`` 0 answers the prompt's logprobs and no output,
    the same values as /v1/completions' ``echo`` with ``max_tokens`` 0, streamed or not."""
    prompt_ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()[
        "tokens"
    ]
    payload = {
        "input_ids": prompt_ids,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    whole = httpx.post(server.url + "/generate", json=payload, timeout=60).json()
    with httpx.stream(
        "POST", server.url + "/generate", json=payload | {"stream": True}, timeout=60
    ) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    echoed = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": prompt_ids, "max_tokens": 0, "echo": True, "logprobs": 0},
        timeout=60,
    ).json()["choices"][0]["logprobs"]
    for answer in (whole, events[-1]):
        meta = answer["meta_info"]
        assert answer["output_ids"] == [] and meta["completion_tokens"] == 0
        assert (
            meta["finish_reason"] == {"type": "length", "length": 0}
            and meta["output_token_logprobs"] == []
        )
        entries = meta["input_token_logprobs"]
        assert [e[1] for e in entries] == prompt_ids and entries[0][0] is None
        assert [e[0] for e in entries[1:]] == pytest.approx(echoed["token_logprobs"][1:], abs=1e-5)


def test_max_new_tokens_0_is_refused_through_pd(
    pd_pair: tuple[ServerProcess, ServerProcess, int],
) -> None:
    """A PD pair always hands a first token over (docs/design.md section 12): scoring a prompt
    is a unified server's job, refused by name on both halves and both routes."""
    for srv in pd_pair[:2]:
        native = httpx.post(
            srv.url + "/generate",
            json={"text": PROMPT, "sampling_params": {"max_new_tokens": 0}},
            timeout=30,
        )
        assert (
            native.status_code == 400
            and native.json()["error"]["param"] == "sampling_params.max_new_tokens"
        ), native.text
        echo = httpx.post(
            srv.url + "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 0, "echo": True},
            timeout=30,
        )
        assert echo.status_code == 400 and echo.json()["error"]["param"] == "max_tokens", echo.text


def test_retracted_requests_logprobs_equal_transformers(
    checkpoint: Path, hf_model, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """Six requests in a KV pool too small for all: the retracted ones re-prefill, and
    their logprobs are still one entry per token, each transformers' value."""
    prompts = [f"{PROMPT} {word}" for word in ("one", "two", "three", "four", "five", "six")]
    args = ["--model-path", str(checkpoint), "--max-total-tokens", "64"]
    srv = ServerProcess(tmp_path / "tmp", args).wait_ready()
    try:
        payloads = [
            {
                "text": p,
                "sampling_params": {"max_new_tokens": 20, "ignore_eos": True, "temperature": 0},
                "return_logprob": True,
                "top_logprobs_num": 2,
            }
            for p in prompts
        ]
        with ThreadPoolExecutor(len(payloads)) as pool:
            answers = list(
                pool.map(
                    lambda body: httpx.post(srv.url + "/generate", json=body, timeout=120).json(),
                    payloads,
                )
            )
        prompt_ids = [
            httpx.post(srv.url + "/tokenize", json={"prompt": p}, timeout=30).json()["tokens"]
            for p in prompts
        ]
    finally:
        srv.stop()
    assert sum(a["meta_info"]["num_retractions"] for a in answers) > 0, (
        "the small pool forced no retraction"
    )
    for answer, ids in zip(answers, prompt_ids):
        out, meta = answer["output_ids"], answer["meta_info"]
        ref = reference(hf_model, ids, out)
        assert [e[1] for e in meta["output_token_logprobs"]] == out, "an entry lost or sent twice"
        assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx(
            [float(ref[j, t]) for j, t in enumerate(out)], abs=1e-4
        )
        assert [[e[1] for e in top] for top in meta["output_top_logprobs"]] == [
            ref[j].topk(2).indices.tolist() for j in range(len(out))
        ]


def test_dllm_mode_serves_logprobs(tmp_path: Path) -> None:
    """--mode dllm serves logprobs: one entry per token of each block, and the prompt's
    (tests/unit/test_dllm_logprobs.py and tests/e2e/test_dllm.py check the values)."""
    srv = ServerProcess(tmp_path / "tmp", ["--mode", "dllm"]).wait_ready()
    try:
        body = {
            "text": "a b",
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 6},
        }
        r = httpx.post(srv.url + "/generate", json=body, timeout=30)
    finally:
        srv.stop()
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] > 0
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
