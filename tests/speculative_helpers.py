"""What the speculative-decoding proof tests share (tests/e2e/test_speculative_*.py): the
target checkpoint (the built-in model's weights, which repeat themselves in greedy text, so
prompt lookup finds drafts), a draft checkpoint cut from it (its first layer: a smaller model
with the same tokenizer whose greedy picks agree with the target's about two times in three),
the server flags of each proposer, the per-request and /metrics counters, the chi-square
p-value, and /generate calls that keep only what must match."""

from __future__ import annotations

import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from safetensors.torch import load_file, save_file

from pipeline.model_config import ModelConfig, default_model_config
from pipeline.tokenizer_loader import (
    DEFAULT_TOKENIZER_DIR,
    SHIPPED_EOS_TOKEN_IDS,
    SHIPPED_VOCAB_SIZE,
)
from scheduler_proc.model.llama import LlamaForCausalLM

K = 4  # drafts per request per step on every speculative server here
DETERMINISTIC = ["--enable-deterministic-inference"]
# No step turns speculation off, for its batch size (so batches of 128 verify drafts too) or
# for its measured cost (which depends on the machine's speed: a test must not).
ALWAYS = ["--speculative-disable-by-batch-size", "0"]


def ngram_args() -> list[str]:
    """vLLM's spelling of prompt lookup."""
    spec = {"method": "ngram", "num_speculative_tokens": K}
    spec |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    return ["--speculative-config", json.dumps(spec)]


def standalone_args(draft: Path) -> list[str]:
    """SGLang's spelling of a draft model."""
    return [
        "--speculative-algorithm", "STANDALONE", "--speculative-num-draft-tokens", str(K),
        "--speculative-draft-model-path", str(draft),
    ]  # fmt: skip


def draft_model_args(draft: Path) -> list[str]:
    """vLLM's spelling of a draft model."""
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}
    return ["--speculative-config", json.dumps(spec)]


def _tokenizer_files(directory: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DEFAULT_TOKENIZER_DIR / name, directory / name)
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": sorted(SHIPPED_EOS_TOKEN_IDS)})
    )


def write_target(directory: Path) -> ModelConfig:
    """The built-in model (its shape, seed 0) as a checkpoint, with the shipped tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    config = default_model_config(SHIPPED_VOCAB_SIZE)
    LlamaForCausalLM.random(config, seed=0, device="cpu").save_pretrained(directory)
    _tokenizer_files(directory)
    return config


def write_layer_draft(target: Path, directory: Path, layers: int = 1) -> None:
    """The target's embeddings, head and first ``layers`` decoder layers as a checkpoint of
    its own: smaller, the same vocabulary and tokenizer, and close enough to the target that
    many of its drafts are accepted."""
    directory.mkdir(parents=True, exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    assert layers < config["num_hidden_layers"], "the draft must be smaller than the target"
    config["num_hidden_layers"] = layers
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    kept = {
        name: tensor
        for name, tensor in load_file(target / "model.safetensors").items()
        if not (match := re.match(r"model\.layers\.(\d+)\.", name)) or int(match[1]) < layers
    }
    save_file(kept, str(directory / "model.safetensors"), metadata={"format": "pt"})
    _tokenizer_files(directory)


# --- requests --------------------------------------------------------------------------


def generate(client: httpx.Client, body: dict[str, Any]) -> Any:
    """/generate's JSON answer (a dict, or a list for a batch), asserting a 200."""
    response = client.post("/generate", json=body)
    assert response.status_code == 200, (body, response.text[:500])
    return response.json()


def streamed_generate(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    """A streamed /generate assembled: the last event's text and ids (SGLang's default
    stream carries the whole output so far), checked to extend every event before it."""
    text, ids, meta = "", list[int](), dict[str, Any]()
    with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            assert event["text"].startswith(text), "a stream event took back text"
            assert event["output_ids"][: len(ids)] == ids, "a stream event took back tokens"
            text, ids, meta = event["text"], event["output_ids"], event["meta_info"]
    return {"text": text, "output_ids": ids, "meta_info": meta}


# --- counters --------------------------------------------------------------------------


@dataclass(frozen=True)
class SpecCounts:
    """A request's speculation counters from its meta_info (SGLang's keys)."""

    verify_ct: int
    draft_tokens: int
    accepted_tokens: int

    @classmethod
    def of(cls, meta: dict[str, Any]) -> SpecCounts:
        return cls(
            int(meta.get("spec_verify_ct", 0)),
            int(meta.get("spec_draft_token_num", 0)),
            int(meta.get("spec_accept_token_num", 0)),
        )


def total_counts(metas: list[dict[str, Any]]) -> SpecCounts:
    counts = [SpecCounts.of(m) for m in metas]
    return SpecCounts(
        sum(c.verify_ct for c in counts),
        sum(c.draft_tokens for c in counts),
        sum(c.accepted_tokens for c in counts),
    )


_SAMPLE = re.compile(r"^(vllm:spec_decode_\w+?)(?:_total)?(\{[^}]*\})? (\S+)$", re.MULTILINE)


def spec_metrics(client: httpx.Client) -> dict[str, float]:
    """vLLM's spec_decode counters on /metrics (``--metrics-compat vllm``), summed over
    every label but ``position``, which keys ``..._per_pos[N]``."""
    found: dict[str, float] = {}
    for name, labels, value in _SAMPLE.findall(client.get("/metrics").text):
        position = re.search(r'position="(\d+)"', labels or "")
        key = f"{name}[{position[1]}]" if position else name
        found[key] = found.get(key, 0.0) + float(value)
    return found


def retractions(client: httpx.Client) -> float:
    """Retractions since the start, by tokenpipe's name or (``--metrics-compat vllm``)
    vLLM's."""
    text = client.get("/metrics").text
    name = r"(?:tokenpipe:num_retracted_requests|vllm:num_preemptions)_total"
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


# --- statistics ------------------------------------------------------------------------


def chi_square_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X chi-square with ``dof`` degrees of freedom: the regularised
    upper incomplete gamma Q(dof/2, statistic/2), by its series below a + 1 and its
    continued fraction (modified Lentz) above (Numerical Recipes' gser and gcf)."""
    a, x = dof / 2.0, statistic / 2.0
    if x <= 0:
        return 1.0
    log_prefix = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        n = a
        while abs(term) > abs(total) * 1e-15:
            n += 1
            term *= x / n
            total += term
        return max(0.0, 1.0 - total * math.exp(log_prefix))
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(log_prefix) * h
