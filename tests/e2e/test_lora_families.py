"""LoRA adapters (docs/design/lora.md) on each served family (tests/hf_checkpoints.py) against
peft on the very adapters peft wrote (tests/lora_adapters.py): for each of three adapters and
the base, greedy tokens equal ``PeftModel.generate``'s and prompt and output logprobs equal
the log-softmax of its forward within 1e-4: alone (a plain and a chunked prefill), in one
batch of 64 mixing the adapters and the base (some retracted), on a prefix-cache hit and a
first visit of each adapter's cache, and through the official ``openai`` client.

One server per family (module-scoped), chunked prefill of 16 tokens and a KV pool of 64
tokens, three adapters over two slots (``--max-loras 2``: a third adapter's requests wait for
a slot). The adapters differ in rank (4, 8, 16), alpha, rsLoRA and targets (the attention
projections only, or all seven), and each changes the answers (checked first)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from tests.e2e.test_model_families import LONG_PROMPT, PROMPTS, encode
from tests.hf_checkpoints import CASES, write_case
from tests.lora_adapters import DEFAULT_TARGETS, require_peft, write_adapter
from tests.server_harness import ServerProcess

NEW_TOKENS = 10
CHUNK = 16
POOL = 64
TOLERANCE = 1e-4
BASE = "base"  # the namespace of a request that names no adapter
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    alpha: int
    targets: tuple[str, ...]
    use_rslora: bool
    seed: int


ADAPTERS = {
    "a": AdapterSpec(rank=4, alpha=8, targets=DEFAULT_TARGETS, use_rslora=False, seed=1),
    "b": AdapterSpec(rank=8, alpha=32, targets=ATTENTION, use_rslora=False, seed=2),
    "c": AdapterSpec(rank=16, alpha=16, targets=DEFAULT_TARGETS, use_rslora=True, seed=3),
}
NAMESPACES = (*ADAPTERS, BASE)
SERVER_ARGS = [
    "--chunked-prefill-size",
    str(CHUNK),
    "--max-total-tokens",
    str(POOL),
    "--max-loras",
    "2",
    "--max-lora-rank",
    str(max(spec.rank for spec in ADAPTERS.values())),
]
# 16 prompts x 4 namespaces: the batch of 64.
BATCH_PROMPTS = [
    *PROMPTS,
    "The rain in Spain stays",
    "My favourite colour is",
    "import numpy as",
    "Water boils at a temperature of",
    "She opened the door and saw",
    "A, B, C, D,",
    "The best way to learn is",
    "In 1492, Columbus",
    "for i in range(10):",
    "Roses are red, violets are",
    "The answer to the question is",
]
# Its first token starts no other prompt here, so its first request under a namespace can
# match nothing that another test cached.
CACHE_PROMPT = "Zebras and giraffes walked together across the dry plain at dawn"


class PeftReference:
    """peft's float32 model of the checkpoint with every adapter loaded under its name;
    greedy answers computed once each."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._greedy: dict[tuple[str, tuple[int, ...]], list[int]] = {}

    @contextlib.contextmanager
    def _active(self, namespace: str) -> Iterator[None]:
        with torch.no_grad():
            if namespace == BASE:
                with self.model.disable_adapter():
                    yield
            else:
                self.model.set_adapter(namespace)
                yield

    def greedy(self, namespace: str, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
        """``PeftModel.generate``'s greedy continuation: ``n`` tokens, EOS not stopping it
        (longer ones computed once, shorter ones their prefix)."""
        key = (namespace, tuple(ids))
        if len(self._greedy.get(key, ())) < n:
            with self._active(namespace):
                out = self.model.generate(
                    input_ids=torch.tensor([ids]),
                    max_new_tokens=max(n, NEW_TOKENS),
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            self._greedy[key] = out[0, len(ids) :].tolist()
            assert len(self._greedy[key]) == max(n, NEW_TOKENS), "peft stopped early"
        return self._greedy[key][:n]

    def log_softmax(self, namespace: str, ids: list[int]) -> torch.Tensor:
        """The log-softmax of peft's forward at every position (row i predicts token i + 1)."""
        with self._active(namespace):
            logits = self.model(input_ids=torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)


def peft_model(base: Any, adapters: dict[str, Path]) -> Any:
    """``base`` (transformers' model of the checkpoint) with every adapter loaded by peft
    under its name, in eval mode."""
    import peft

    names = iter(adapters)
    first = next(names)
    model = peft.PeftModel.from_pretrained(base, adapters[first], adapter_name=first)
    for name in names:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


def write_adapters(checkpoint: Path, out: Path) -> dict[str, Path]:
    """Every adapter of ``ADAPTERS`` written by peft, checked to say what it was asked."""
    written = {}
    for name, spec in ADAPTERS.items():
        directory = write_adapter(
            checkpoint,
            out / name,
            rank=spec.rank,
            alpha=spec.alpha,
            target_modules=spec.targets,
            seed=spec.seed,
            use_rslora=spec.use_rslora,
        )
        config = json.loads((directory / "adapter_config.json").read_text())
        assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (
            spec.rank,
            spec.alpha,
            spec.use_rslora,
        )
        assert sorted(config["target_modules"]) == sorted(spec.targets)
        written[name] = directory
    return written


@dataclass
class Family:
    case: str
    reference: PeftReference
    server: ServerProcess
    _alone: dict[tuple[str, tuple[int, ...]], dict[str, Any]] = field(default_factory=dict)

    def alone(self, namespace: str, ids: list[int]) -> dict[str, Any]:
        """The server's answer to ``ids`` under ``namespace`` sent alone (asked once)."""
        key = (namespace, tuple(ids))
        if key not in self._alone:
            self._alone[key] = generate(self.server, ids, namespace)
        return self._alone[key]


@pytest.fixture(scope="module", params=sorted(CASES))
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Family]:
    require_peft()
    case = request.param
    checkpoint = tmp_path_factory.mktemp(f"{case}-checkpoint")
    base = write_case(checkpoint, case)
    adapters = write_adapters(checkpoint, tmp_path_factory.mktemp(f"{case}-adapters"))
    modules = [f"{name}={path}" for name, path in adapters.items()]
    server = ServerProcess(
        tmp_path_factory.mktemp(f"{case}-server") / "tmp",
        ["--model-path", str(checkpoint), *SERVER_ARGS, "--lora-modules", *modules],
    )
    # One thread for peft here: two would spin against the server's for the 2 cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = PeftReference(peft_model(base, adapters))  # while the server starts
        server.wait_ready()
        yield Family(case, reference, server)
    finally:
        server.stop()
        torch.set_num_threads(threads)


def lora_path(namespace: str) -> str | None:
    return None if namespace == BASE else namespace


def sampling(n: int = NEW_TOKENS) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def generate(
    server: ServerProcess, ids: list[int], namespace: str, logprob_start_len: int = 0
) -> dict[str, Any]:
    """/generate of ``ids`` under ``namespace`` (SGLang's ``lora_path``; none for the base),
    with prompt and output logprobs from ``logprob_start_len`` on."""
    body: dict[str, Any] = {
        "input_ids": ids,
        "sampling_params": sampling(),
        "return_logprob": True,
        "logprob_start_len": logprob_start_len,
    }
    if namespace != BASE:
        body["lora_path"] = namespace
    r = httpx.post(server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


def assert_equals_peft(
    reference: PeftReference,
    namespace: str,
    ids: list[int],
    answer: dict[str, Any],
    logprob_start_len: int = 0,
) -> None:
    """The answer's tokens are peft's greedy ones under ``namespace``, and each prompt
    logprob (from ``logprob_start_len`` on) and output logprob is the log-softmax of peft's
    forward within ``TOLERANCE``."""
    out, meta = answer["output_ids"], answer["meta_info"]
    assert len(out) == NEW_TOKENS
    assert out == reference.greedy(namespace, ids), f"{namespace}: tokens differ from peft's"
    ref = reference.log_softmax(namespace, ids + out)
    prompt = meta["input_token_logprobs"]
    assert [e[1] for e in prompt] == ids[logprob_start_len:]
    if logprob_start_len == 0:  # the first token has nothing before it
        assert prompt[0][0] is None
        prompt = prompt[1:]
    first = max(logprob_start_len, 1)
    expected_prompt = [float(ref[q - 1, ids[q]]) for q in range(first, len(ids))]
    assert [e[0] for e in prompt] == pytest.approx(expected_prompt, abs=TOLERANCE), namespace
    assert [e[1] for e in meta["output_token_logprobs"]] == out
    expected = [float(ref[len(ids) - 1 + j, t]) for j, t in enumerate(out)]
    output = [e[0] for e in meta["output_token_logprobs"]]
    assert output == pytest.approx(expected, abs=TOLERANCE), namespace


def test_every_adapter_changes_the_answers(family: Family) -> None:
    """peft's own answers differ between every two namespaces on some prompt: otherwise the
    tests below could not tell one adapter from another or from the base."""
    answers = {
        namespace: tuple(
            tuple(family.reference.greedy(namespace, encode(prompt))) for prompt in BATCH_PROMPTS
        )
        for namespace in NAMESPACES
    }
    assert len(set(answers.values())) == len(NAMESPACES), answers


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_alone_each_adapter_and_the_base_answer_as_peft(family: Family, namespace: str) -> None:
    """Plain prefills, and a prompt longer than two chunks (chunked prefill)."""
    long_ids = encode(LONG_PROMPT)
    assert 2 * CHUNK < len(long_ids) <= POOL - NEW_TOKENS
    for ids in [*(encode(prompt) for prompt in PROMPTS), long_ids]:
        assert_equals_peft(family.reference, namespace, ids, family.alone(namespace, ids))


def test_a_batch_mixing_adapters_and_the_base_answers_as_each_alone(family: Family) -> None:
    """64 requests in one /generate batch (a ``lora_path`` per prompt, null for the base):
    three adapters over two slots, so some wait for a slot, and a pool too small for them,
    so some are retracted and re-prefilled with their adapter. Each answers what it answers
    alone, and peft's tokens and logprobs."""
    items = [(namespace, encode(prompt)) for prompt in BATCH_PROMPTS for namespace in NAMESPACES]
    body = {
        "input_ids": [ids for _, ids in items],
        "lora_path": [lora_path(namespace) for namespace, _ in items],
        "sampling_params": sampling(),
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    r = httpx.post(family.server.url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    answers = r.json()
    assert len(answers) == len(items) == 64
    retractions = sum(answer["meta_info"]["num_retractions"] for answer in answers)
    assert retractions >= 1, "the small pool forced no retraction"
    for (namespace, ids), answer in zip(items, answers):
        assert answer["output_ids"] == family.alone(namespace, ids)["output_ids"], namespace
        assert_equals_peft(family.reference, namespace, ids, answer)


def test_the_prefix_cache_is_kept_per_adapter(family: Family) -> None:
    """The same prompt twice under one adapter: the second hits its cache. Then under each
    other adapter and the base: nothing cached for it there, and peft's answer. The prompt
    logprobs are asked from the last 3 prompt tokens on, so the positions before them may
    come from the cache."""
    ids = encode(CACHE_PROMPT)
    others = [encode(prompt) for prompt in [*BATCH_PROMPTS, LONG_PROMPT]]
    assert all(other[0] != ids[0] for other in others)
    start = len(ids) - 3
    first = generate(family.server, ids, "a", start)
    again = generate(family.server, ids, "a", start)
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] > 0, "the second identical request missed"
    assert again["output_ids"] == first["output_ids"]
    assert_equals_peft(family.reference, "a", ids, again, start)
    for namespace in ("b", "c", BASE):
        answer = generate(family.server, ids, namespace, start)
        assert answer["meta_info"]["cached_tokens"] == 0, f"{namespace} read a's KV"
        assert_equals_peft(family.reference, namespace, ids, answer, start)


@pytest.mark.parametrize("family", ["llama3"], indirect=True)
def test_the_openai_client_names_an_adapter_by_model(family: Family) -> None:
    """completions.create(model=NAME) answers what /generate with lora_path NAME answers (and
    peft's tokens); the base's own name is the base; /v1/models lists every adapter."""
    client = family.server.openai_client()
    served = [card.id for card in client.models.list().data]
    assert set(ADAPTERS) <= set(served)
    base_name = next(name for name in served if name not in ADAPTERS)
    ids = encode(PROMPTS[1])
    for namespace in NAMESPACES:
        model = base_name if namespace == BASE else namespace
        completion = client.completions.create(
            model=model,
            prompt=ids,
            max_tokens=NEW_TOKENS,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
        native = generate(family.server, ids, namespace)
        assert completion.model == model
        choice = completion.choices[0]
        assert choice.text == native["text"], namespace
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        native_logprobs = [e[0] for e in native["meta_info"]["output_token_logprobs"]]
        assert choice.logprobs.token_logprobs == pytest.approx(native_logprobs, abs=TOLERANCE)
        assert native["output_ids"] == family.reference.greedy(namespace, ids), namespace
