"""``--skip-tokenizer-init``: token ids in, token ids out, and no process loads a tokenizer.

The servers are real ``tokenpipe serve`` processes. The proof that no process loads a
tokenizer is a model directory with no tokenizer files at all: with the flag it serves, and
without it the same directory does not start.
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from detokenizer_proc.main import detokenize_frame
from pipeline.config import ServerConfig
from pipeline.io_struct import (
    COUNT_DTYPE,
    REQ_ID_DTYPE,
    TOKEN_DTYPE,
    BatchTokenIDOutput,
    FinishAbort,
    FinishStop,
    SamplingParams,
    TokenizedGenerateReqInput,
)
from pipeline.model_config import ModelConfig
from pipeline.tokenizer_loader import (
    SHIPPED_EOS_TOKEN_IDS,
    SHIPPED_VOCAB_SIZE,
    TokenizerLoadError,
    load_model_vocab,
    load_tokenizer,
)
from scheduler_proc.main import build_scheduler
from scheduler_proc.model.llama import LlamaForCausalLM
from tests.server_harness import REPO, RoleProcesses, ServerProcess, tokenpipe_command

FLAG = "--skip-tokenizer-init"
PROMPTS = [[17, 300, 1200, 45, 9], [2048, 77, 3001, 5, 5, 5, 400], [1000]]
GREEDY = {"temperature": 0, "max_new_tokens": 12}
DIR_VOCAB = 512  # the tokenizer-free model directory's own vocabulary
DIR_EOS = 7


def write_ids_only_dir(directory: Path) -> Path:
    """A model directory as a client of --skip-tokenizer-init might have: weights, config.json
    and generation_config.json, and no tokenizer file of any kind."""
    shape = ModelConfig(
        vocab_size=DIR_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    LlamaForCausalLM.random(shape, seed=5, device="cpu").save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": DIR_EOS}))
    return directory


@pytest.fixture(scope="module")
def skip_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The built-in model (same seed as the shared ``server``), with the flag."""
    srv = ServerProcess(tmp_path_factory.mktemp("skip-server") / "tmp", [FLAG]).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def skip(skip_server: ServerProcess) -> Iterator[httpx.Client]:
    with skip_server.client() as c:
        yield c


@pytest.fixture(scope="module")
def ids_only_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_ids_only_dir(tmp_path_factory.mktemp("ids-only-model"))


def sse_payloads(
    client: httpx.Client,
    path: str,
    body: dict,  # type: ignore[type-arg]
) -> list[dict]:  # type: ignore[type-arg]
    """The JSON events of a stream, which must end with ``[DONE]``."""
    events: list[dict] = []  # type: ignore[type-arg]
    with client.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        events.append(json.loads(line[len("data: ") :]))
    return events


def assert_refused(resp: httpx.Response, param: str, *words: str) -> str:
    """A 400 in the error shape whose message names the flag, and ``words``."""
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "code"} and error["code"] == 400
    assert error.get("param") == param, error
    message: str = error["message"]
    for word in (FLAG, *words):
        assert word in message, message
    return message


# --- ids in, ids out -----------------------------------------------------------------------


def test_generate_takes_input_ids_and_answers_output_ids_without_text(skip: httpx.Client) -> None:
    body = {"input_ids": PROMPTS[0], "sampling_params": {**GREEDY, "ignore_eos": True}}
    out = skip.post("/generate", json=body).json()
    # As SGLang answers in this mode: output_ids and meta_info, no text key at all.
    assert set(out) == {"output_ids", "meta_info"}
    assert len(out["output_ids"]) == 12 == out["meta_info"]["completion_tokens"]
    assert out["meta_info"]["prompt_tokens"] == len(PROMPTS[0])
    assert all(0 <= t < SHIPPED_VOCAB_SIZE for t in out["output_ids"])


def test_greedy_ids_equal_those_of_a_server_with_a_tokenizer(
    skip: httpx.Client, http: httpx.Client
) -> None:
    # EOS is left on: both servers must also agree on which ids end a sequence.
    for prompt in PROMPTS:
        body = {"input_ids": prompt, "sampling_params": GREEDY}
        ours, theirs = (
            skip.post("/generate", json=body).json(),
            http.post("/generate", json=body).json(),
        )
        assert ours["output_ids"] == theirs["output_ids"]
        assert ours["meta_info"]["finish_reason"] == theirs["meta_info"]["finish_reason"]


def test_streamed_generate_sends_the_output_ids_so_far(skip: httpx.Client) -> None:
    """As SGLang streams by default: each event's output_ids are all those through it."""
    body = {"input_ids": PROMPTS[1], "sampling_params": {**GREEDY, "ignore_eos": True}}
    whole = skip.post("/generate", json=body).json()["output_ids"]
    events = sse_payloads(skip, "/generate", body)
    assert all(set(event) == {"output_ids", "meta_info"} for event in events)
    assert [event["output_ids"] for event in events] == [
        whole[: e["meta_info"]["completion_tokens"]] for e in events
    ]
    assert (
        len(events) > 1 and events[-1]["output_ids"] == whole
    )  # one event per row, the last the whole
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


def test_completions_take_a_token_prompt_and_answer_token_ids(skip: httpx.Client) -> None:
    want = skip.post(
        "/generate",
        json={"input_ids": PROMPTS[2], "sampling_params": {**GREEDY, "ignore_eos": True}},
    ).json()
    body = {"prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    out = skip.post("/v1/completions", json=body).json()
    choice = out["choices"][0]
    # vLLM's empty text without a tokenizer, and the ids as both answer return_token_ids.
    assert choice["text"] == ""
    assert choice["token_ids"] == want["output_ids"]
    assert out["usage"]["prompt_tokens"] == 1 and out["usage"]["completion_tokens"] == 12

    chunks = sse_payloads(skip, "/v1/completions", body)
    deltas = [c["choices"][0] for c in chunks]
    assert all(d["text"] == "" for d in deltas)
    assert [t for d in deltas for t in d["token_ids"]] == want["output_ids"]
    assert deltas[-1]["finish_reason"] == "length"


def test_echo_of_a_token_prompt_is_empty_text(skip: httpx.Client) -> None:
    """Without a tokenizer a prompt has no text to echo: "", as the completion's own text is
    (vLLM's), streamed or not; with logprobs the prompt's tokens still lead them."""
    body = {
        "prompt": PROMPTS[2],
        "max_tokens": 2,
        "echo": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    assert skip.post("/v1/completions", json=body).json()["choices"][0]["text"] == ""
    streamed = [c["choices"][0]["text"] for c in sse_payloads(skip, "/v1/completions", body)]
    assert streamed and set(streamed) == {""}
    scored = skip.post("/v1/completions", json={**body, "logprobs": 0}).json()["choices"][0]
    assert scored["text"] == "" and scored["logprobs"]["tokens"][0] == f"token_id:{PROMPTS[2][0]}"


def test_stop_token_ids_still_stop(skip: httpx.Client) -> None:
    body = {"input_ids": PROMPTS[0], "sampling_params": {**GREEDY, "ignore_eos": True}}
    ids = skip.post("/generate", json=body).json()["output_ids"]
    stop_at = ids[3]
    body["sampling_params"] = {**GREEDY, "ignore_eos": True, "stop_token_ids": [stop_at]}
    out = skip.post("/generate", json=body).json()
    assert out["output_ids"][-1] == stop_at and len(out["output_ids"]) == ids.index(stop_at) + 1
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}


def test_server_info_and_health_generate_need_no_tokenizer(skip: httpx.Client) -> None:
    info = skip.get("/server_info").json()
    assert info["skip_tokenizer_init"] is True
    assert info["vocab_size"] == SHIPPED_VOCAB_SIZE
    assert info["model_name"] == "tokenpipe-tiny"
    assert skip.get("/health_generate").status_code == 200


# --- what needs text is refused --------------------------------------------------------------


def test_text_prompts_are_refused_naming_the_flag(skip: httpx.Client) -> None:
    assert_refused(skip.post("/generate", json={"text": "hello"}), "text", "token ids")
    assert_refused(
        skip.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4}),
        "prompt",
        "token ids",
    )
    assert_refused(
        skip.post("/v1/completions", json={"prompt": ["hello", "again"], "max_tokens": 4}),
        "prompt",
        "token ids",
    )


def test_chat_is_refused_naming_the_flag(skip: httpx.Client) -> None:
    resp = skip.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert_refused(resp, "messages", "chat", "token ids")


def test_stop_strings_are_refused_naming_stop(skip: httpx.Client) -> None:
    body = {"input_ids": PROMPTS[0], "sampling_params": {**GREEDY, "stop": ["\n"]}}
    assert_refused(
        skip.post("/generate", json=body),
        "sampling_params.stop",
        "sampling_params.stop",
        "stop_token_ids",
    )
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "stop": "\n"}
    message = assert_refused(skip.post("/v1/completions", json=body), "stop", "stop_token_ids")
    assert "sampling_params" not in message  # the OpenAI client's own field name


def test_media_is_refused_naming_its_field(skip: httpx.Client) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (10, 20, 30)).save(buf, "PNG")
    body = {
        "input_ids": PROMPTS[0],
        "image_data": base64.b64encode(buf.getvalue()).decode(),
        "sampling_params": GREEDY,
    }
    assert_refused(skip.post("/generate", json=body), "image_data", "<|image|>")


def test_tokenize_routes_are_refused_naming_the_flag(skip: httpx.Client) -> None:
    assert_refused(skip.post("/tokenize", json={"prompt": "hello"}), "prompt", "/tokenize")
    assert_refused(
        skip.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}),
        "messages",
        "/tokenize",
    )
    assert_refused(skip.post("/detokenize", json={"tokens": [5, 6]}), "tokens", "/detokenize")


def test_embeddings_take_token_ids_and_refuse_text(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "tmp", ["--mode", "embedding", FLAG]).wait_ready()
    try:
        with srv.client() as c:
            out = c.post("/v1/embeddings", json={"input": [[5, 6, 7], [8]]}).json()
            assert [len(d["embedding"]) for d in out["data"]] == [256, 256]
            assert_refused(
                c.post("/v1/embeddings", json={"input": "hello"}), "input[0]", "token ids"
            )
    finally:
        srv.stop()


# --- no process loads a tokenizer -------------------------------------------------------------


@contextmanager
def lone_processes(*args: str) -> Iterator[httpx.Client]:
    """``tokenpipe scheduler``, ``detokenizer`` and ``api`` run one by one over tcp://, each
    given ``args``, as deploy/supervisord.conf runs them; the client once /health_generate
    got through."""
    with RoleProcesses(args) as procs, httpx.Client(base_url=procs.url, timeout=60) as client:
        yield client


def test_a_model_directory_without_tokenizer_files_serves_with_the_flag(ids_only_dir: Path) -> None:
    assert not [p.name for p in ids_only_dir.iterdir() if "token" in p.name]
    with lone_processes("--model-path", str(ids_only_dir), FLAG) as c:
        body = {"input_ids": [1, 2, 3], "sampling_params": {**GREEDY, "ignore_eos": True}}
        out = c.post("/generate", json=body).json()
        assert len(out["output_ids"]) == 12 and all(0 <= t < DIR_VOCAB for t in out["output_ids"])
        streamed = sse_payloads(c, "/generate", body)
        assert streamed[-1]["output_ids"] == out["output_ids"]  # each event holds the ids so far
        info = c.get("/server_info").json()
        assert info["vocab_size"] == DIR_VOCAB and info["model_name"] == ids_only_dir.name
        # The vocabulary comes from config.json, so an id past it is refused.
        resp = c.post("/generate", json={"input_ids": [DIR_VOCAB]})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "input_ids"


def test_without_the_flag_that_directory_does_not_start(ids_only_dir: Path, tmp_path: Path) -> None:
    """The control for the test above: a process that loaded a tokenizer would fail there."""
    run = subprocess.run(
        tokenpipe_command(
            "serve", "--model-path", str(ids_only_dir), "--port", "0", "--log-level", "warning"
        ),
        cwd=REPO,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode != 0
    assert "tokenizer.json not found" in run.stdout + run.stderr


# --- the pieces, without servers -------------------------------------------------------------


def test_shipped_vocabulary_constants_match_the_shipped_tokenizer() -> None:
    shipped = load_tokenizer(None)
    vocab = load_model_vocab(None)
    assert (vocab.vocab_size, vocab.eos_token_ids, vocab.name) == (
        shipped.vocab_size,
        shipped.eos_token_ids,
        shipped.name,
    )
    assert (SHIPPED_VOCAB_SIZE, SHIPPED_EOS_TOKEN_IDS) == (
        shipped.vocab_size,
        shipped.eos_token_ids,
    )


def test_model_vocab_reads_config_and_generation_config(ids_only_dir: Path, tmp_path: Path) -> None:
    vocab = load_model_vocab(ids_only_dir)
    assert (vocab.vocab_size, vocab.eos_token_ids) == (DIR_VOCAB, frozenset({DIR_EOS}))
    # Without a generation config, config.json's eos_token_id counts, as load_tokenizer reads it.
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 100, "eos_token_id": [3, 4]}))
    assert load_model_vocab(tmp_path).eos_token_ids == frozenset({3, 4})
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 100, "eos_token_id": 100}))
    with pytest.raises(TokenizerLoadError, match="eos_token_id"):
        load_model_vocab(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(TokenizerLoadError, match="config.json not found"):
        load_model_vocab(tmp_path)


def test_detokenizer_without_tokenizer_passes_ids_with_empty_text() -> None:
    frame = BatchTokenIDOutput(
        req_ids=np.array([7, 8], dtype=REQ_ID_DTYPE).tobytes(),
        output_ids=np.array([5, 6, 9], dtype=TOKEN_DTYPE).tobytes(),
        output_counts=np.array([2, 1], dtype=COUNT_DTYPE).tobytes(),
        completion_tokens=np.array([2, 1], dtype=COUNT_DTYPE).tobytes(),
        finished_reasons=[None, FinishStop(matched=9)],
    )
    out = detokenize_frame(None, frame)
    assert out.text_deltas == ["", ""]
    assert (out.req_ids, out.output_ids, out.output_counts) == (
        frame.req_ids,
        frame.output_ids,
        frame.output_counts,
    )
    assert out.finished_reasons == frame.finished_reasons
    bad = BatchTokenIDOutput(
        frame.req_ids,
        frame.output_ids,
        frame.output_counts,
        frame.completion_tokens,
        finished_reasons=[None],
    )
    with pytest.raises(ValueError, match="finished_reasons"):
        detokenize_frame(None, bad)


def test_scheduler_without_tokenizer_refuses_stop_strings_itself() -> None:
    """The API refuses them first; this guards the scheduler against a frame from elsewhere."""
    scheduler = build_scheduler(
        ServerConfig(max_total_tokens=1024, torch_threads=1, skip_tokenizer_init=True)
    )
    sampling = SamplingParams(max_new_tokens=4, stop=("x",))
    msg = TokenizedGenerateReqInput(
        rid="r",
        req_id=1,
        input_ids=[5, 6],
        sampling_params=sampling,
        stream=False,
        arrival_time=0.0,
    )
    scheduler.add_request(msg)
    (out,) = scheduler.step()
    reason = out.finished_reasons[0]  # type: ignore[union-attr,index]
    assert isinstance(reason, FinishAbort) and reason.status_code == 400 and FLAG in reason.message
