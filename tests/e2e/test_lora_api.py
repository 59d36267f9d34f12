"""The LoRA API as vLLM's and SGLang's users drive it (docs/api.md, "LoRA adapters"), through
one server (module-scoped) on a tiny Llama 3 checkpoint with one adapter named at start
(``--lora-modules``) and another loaded at run time, both written by peft: the official
``openai`` client lists the adapters with their base and runs an adapter by ``model``;
vLLM's endpoints load one while another request streams, serve it, and unload it (its running
request finishes on it; a new one gets the unknown model's 404); SGLang's endpoints and
``lora_path`` on /generate, single and batched; ``--metrics-compat vllm`` serves
``vllm:lora_requests_info`` and the per-adapter request count. Whether an adapter's rows equal
peft's is tests/e2e/test_lora_families.py's."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.hf_checkpoints import write_case
from tests.lora_adapters import require_peft, write_adapter
from tests.server_harness import ServerProcess, wait_until

BASE = "tiny-llama"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
PROMPT = "The quick brown fox jumps over"
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}
LONG = 120  # tokens of a stream that runs while an adapter is loaded or unloaded


@dataclass(frozen=True)
class Served:
    server: ServerProcess
    sql: Path  # named at start
    chat: Path  # loaded at run time
    started: float

    @property
    def oai(self) -> openai.OpenAI:
        return self.server.openai_client()

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(self.server.url + path, json=body, timeout=120)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    require_peft()
    root = tmp_path_factory.mktemp("lora-api")
    checkpoint = root / "checkpoint"
    write_case(checkpoint, "llama3")
    sql = write_adapter(checkpoint, root / "sql", rank=4, alpha=8, seed=1)
    chat = write_adapter(checkpoint, root / "chat", rank=8, alpha=16, target_modules=ATTENTION)
    args = ["--model-path", str(checkpoint), "--served-model-name", BASE]
    args += ["--enable-lora", "--lora-modules", f"sql={sql}", "--max-loras", "2"]
    args += ["--max-lora-rank", "8", "--metrics-compat", "vllm"]
    # A batch item's tokens are then the bits it gets alone (no near tie flips).
    args += ["--enable-deterministic-inference"]
    started = time.time()
    server = ServerProcess(root / "server" / "tmp", args)
    with server.wait_ready():
        yield Served(server, sql, chat, started)


def token_logprobs(served: Served, model: str) -> list[float]:
    answer = served.oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, logprobs=0, **GREEDY
    )
    assert answer.model == model  # vLLM's: the adapter's name for an adapter's answer
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    return [float(x) for x in logprobs.token_logprobs]


def test_models_list_the_adapters_after_the_base(served: Served) -> None:
    info = httpx.get(served.server.url + "/server_info", timeout=30)
    assert info.status_code == 200, info.text  # its report's adapters are JSON too
    assert {"name": "sql", "path": str(served.sql), "id": 1} in info.json()["scheduler"][
        "lora_adapters"
    ]
    cards = served.oai.models.list().data
    assert [card.id for card in cards] == [BASE, "sql"]
    sql = cards[1].model_extra or {}
    assert (sql["root"], sql["parent"]) == (str(served.sql), BASE)
    assert (cards[0].model_extra or {})["parent"] is None
    assert (served.oai.models.retrieve("sql").model_extra or {})["parent"] == BASE


def test_a_completion_runs_with_the_adapter_its_model_names(served: Served) -> None:
    base = token_logprobs(served, BASE)
    sql = token_logprobs(served, "sql")
    # The adapter's rows are not the base model's: far beyond a cache hit's rounding.
    assert max(abs(a - b) for a, b in zip(base, sql, strict=True)) > 1e-3
    chat = served.oai.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4, **GREEDY
    )
    assert chat.model == "sql" and chat.usage is not None and chat.usage.completion_tokens == 4


def test_n_streaming_and_a_json_schema_run_with_the_adapter(served: Served) -> None:
    """Per-request state an adapter rides with: n choices, a stream, a grammar."""
    oai, messages = served.oai, [{"role": "user", "content": "Name a colour"}]
    alone = oai.chat.completions.create(model="sql", messages=messages, max_tokens=8, **GREEDY)
    base = oai.chat.completions.create(model=BASE, messages=messages, max_tokens=8, **GREEDY)
    want = alone.choices[0].message.content
    assert want != base.choices[0].message.content  # the adapter changes this answer
    both = oai.chat.completions.create(model="sql", messages=messages, max_tokens=8, n=2, **GREEDY)
    assert [c.message.content for c in both.choices] == [want, want]
    stream = oai.chat.completions.create(
        model="sql", messages=messages, max_tokens=8, stream=True, **GREEDY
    )
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == want
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "maxLength": 12}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    shaped = oai.chat.completions.create(
        model="sql",
        messages=messages,
        max_tokens=40,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "colour", "schema": schema, "strict": True},
        },
        temperature=0,
    )
    content = shaped.choices[0].message.content
    assert shaped.model == "sql" and content is not None
    assert set(json.loads(content)) == {"colour"}


def test_vllm_load_while_a_request_streams_use_then_unload(served: Served) -> None:
    oai = served.oai
    stream = oai.completions.create(
        model=BASE, prompt=PROMPT, max_tokens=LONG, stream=True, **GREEDY
    )
    chunks = iter(stream)
    first = next(chunks)
    loaded = served.post(
        "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(served.chat)}
    )
    assert (loaded.status_code, loaded.text) == (
        200,
        "Success: LoRA adapter 'chat' added successfully.",
    )
    # The stream goes on whole; the new adapter serves at once (this worker learnt it).
    rest = list(chunks)
    text = first.choices[0].text + "".join(c.choices[0].text for c in rest if c.choices)
    assert rest[-1].choices[0].finish_reason == "length" and text
    assert [card.id for card in oai.models.list().data] == [BASE, "sql", "chat"]
    used = oai.completions.create(model="chat", prompt=PROMPT, max_tokens=4, **GREEDY)
    assert used.model == "chat" and used.usage is not None and used.usage.completion_tokens == 4
    again = served.post(
        "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": str(served.chat)}
    )
    assert again.status_code == 400
    assert again.json()["error"]["message"].startswith(
        "The lora adapter 'chat' has already been loaded."
    )
    # A request running on it when it is unloaded finishes on it.
    running = oai.completions.create(
        model="chat", prompt=PROMPT, max_tokens=LONG, stream=True, **GREEDY
    )
    events = iter(running)
    next(events)
    gone = served.post("/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert (gone.status_code, gone.text) == (
        200,
        "Success: LoRA adapter 'chat' removed successfully.",
    )
    assert [e for e in events if e.choices][-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError) as missing:
        oai.completions.create(model="chat", prompt=PROMPT, max_tokens=4)
    assert missing.value.status_code == 404
    assert "the model 'chat' does not exist" in str(missing.value)
    twice = served.post("/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert twice.status_code == 404
    assert twice.json()["error"]["message"] == "The lora adapter 'chat' cannot be found."


def generate(served: Served, body: dict[str, Any]) -> httpx.Response:
    sampling = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    return served.post("/generate", {"sampling_params": sampling, **body})


def test_sglang_endpoints_and_lora_path(served: Served) -> None:
    loaded = served.post(
        "/load_lora_adapter", {"lora_name": "chat2", "lora_path": str(served.chat)}
    )
    assert loaded.status_code == 200
    assert loaded.json() == {
        "success": True,
        "error_message": "",
        "loaded_adapters": {"sql": str(served.sql), "chat2": str(served.chat)},
    }
    single = {
        name: generate(served, {"text": PROMPT, "lora_path": name}).json()
        for name in ("chat2", None)
    }
    assert all(answer["meta_info"]["completion_tokens"] == 5 for answer in single.values())
    batch = generate(served, {"text": [PROMPT, PROMPT], "lora_path": ["chat2", None]})
    assert batch.status_code == 200, batch.text
    # Each prompt of a batch runs with its own adapter, as it does alone.
    assert [a["output_ids"] for a in batch.json()] == [
        single["chat2"]["output_ids"],
        single[None]["output_ids"],
    ]
    unknown = generate(served, {"text": PROMPT, "lora_path": "nope"})
    assert unknown.status_code == 400
    assert unknown.json()["error"]["message"].startswith(
        "The following requested LoRA adapters are not loaded: nope"
    )
    gone = served.post("/unload_lora_adapter", {"lora_name": "chat2"})
    assert gone.status_code == 200
    assert gone.json()["loaded_adapters"] == {"sql": str(served.sql)}
    twice = served.post("/unload_lora_adapter", {"lora_name": "chat2"})
    assert twice.status_code == 400 and twice.json()["success"] is False
    assert twice.json()["error_message"].startswith("LoRA with name chat2 does not exist.")


def samples(served: Served, name: str) -> list[tuple[dict[str, str], float]]:
    text = httpx.get(served.server.url + "/metrics", timeout=30).text
    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]


def test_vllm_lora_metrics(served: Served) -> None:
    def sql_requests() -> float:
        found = samples(served, "tokenpipe:lora_requests_total")
        return sum(value for labels, value in found if labels["lora_name"] == "sql")

    before = sql_requests()
    served.oai.completions.create(model="sql", prompt=PROMPT, max_tokens=2, **GREEDY)
    served.oai.completions.create(model=BASE, prompt=PROMPT, max_tokens=2, **GREEDY)
    assert sql_requests() == before + 1  # counted by adapter; the base request is not

    def idle_report_seen() -> bool:
        found = samples(served, "vllm:lora_requests_info")
        idle = {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
        return any(labels == idle and value >= served.started for labels, value in found)

    # Set from the scheduler's reports: the one it sends once idle shows no adapter running.
    assert wait_until(idle_report_seen, timeout=30)
