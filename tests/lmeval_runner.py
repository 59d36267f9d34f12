"""Runs lm-eval (EleutherAI's harness, PyPI ``lm-eval``, pinned in the test extra) on the
multiple-choice task in ``tests/lmeval_task/`` and reads back its accuracy and every
choice's loglikelihood, from two models: ``hf`` (transformers on a checkpoint directory, the
reference) and ``local-completions`` (a server's ``/v1/completions``). Its CLI runs as a
subprocess, offline, with ``--log_samples``: the per-choice loglikelihoods come from the
samples file, the accuracy from the results file.

What ``local-completions`` sends (read from lm-eval 0.4.13's source and recorded by a stub
server): one ``POST /v1/completions`` per choice (batch size 1), with the body ::

    {"model": MODEL, "prompt": [[context ids + continuation ids]], "temperature": 0,
     "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": true}

and the header ``Authorization: Bearer $OPENAI_API_KEY`` (``Bearer `` when unset). The prompt
is a list of lists of token ids (``tokenized_requests=True``): lm-eval tokenizes locally with
the checkpoint's tokenizer, so the ids are the very ones ``hf`` scores and the server does no
tokenizing. With ``--batch_size N`` the prompt holds N lists and one choice comes back per
list. From the answer it reads only ``choices[].index`` (to order them) and, of each choice's
``logprobs``, ``token_logprobs[ctxlen:-1]`` (summed: the echoed continuation, the one
generated token dropped) and ``top_logprobs[ctxlen:-1]`` (dicts; a continuation token whose
logprob equals its dict's maximum counts as greedy). ``tokens`` and ``text_offset`` are not
read. So the server must echo the prompt with a logprob per prompt token (the first one may
be null) and generate exactly one token after it.

lm-eval is skipped when missing, except under CI=true, where a missing lm-eval fails the
test instead."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.server_harness import offline_hub_env

LM_EVAL_VERSION = (
    "0.4.13"  # its request body and samples file are what we read: keep in step with pyproject
)
TASK_DIR = Path(__file__).resolve().parent / "lmeval_task"
TASK = "tokenpipe_mc"


@dataclass(frozen=True)
class DocScores:
    """One document of the task, as lm-eval scored it."""

    target: int  # the index of the right choice
    loglikelihoods: tuple[float, ...]  # one per choice, in the task's order


@dataclass(frozen=True)
class LmEvalResult:
    accuracy: float  # lm-eval's ``acc``: the share of docs whose right choice scored highest
    docs: dict[int, DocScores]  # by lm-eval's doc_id: the line number in questions.jsonl


def require_lm_eval() -> None:
    """Skips (or fails under CI=true) unless the pinned lm-eval and its ``hf`` extra's
    accelerate (which lm-eval's hf model imports) are installed."""
    missing = []
    for dist, wanted in (("lm-eval", LM_EVAL_VERSION), ("accelerate", None)):
        try:
            found = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            missing.append(f"{dist} is not installed")
            continue
        if wanted is not None and found != wanted:
            missing.append(f"{dist}=={wanted} is not installed (found {found})")
    if not missing:
        return
    message = "; ".join(missing)
    if os.environ.get("CI") == "true":
        pytest.fail(message + " (CI=true: a missing lm-eval is a failure)")
    pytest.skip(message)


def run_hf(checkpoint: Path, workdir: Path) -> LmEvalResult:
    """lm-eval's ``hf`` model (transformers, float32, CPU) on ``checkpoint``."""
    model_args = f"pretrained={checkpoint},dtype=float32"
    return _run("hf", model_args, workdir, ["--device", "cpu"], env={})


def run_local_completions(
    server_url: str, tokenizer_dir: Path, workdir: Path, *, model: str, api_key: str | None = None
) -> LmEvalResult:
    """lm-eval's ``local-completions`` model against ``{server_url}/v1/completions``, asking
    for ``model`` and tokenizing with the tokenizer in ``tokenizer_dir``. The tokenizer backend
    is named: left to ``auto``, lm-eval first probes the server's ``/tokenizer_info`` and
    ``/tokenize`` (vLLM's), three tries each. One try per request: the server's answer is
    deterministic, and a refusal should fail at once with its message in the output."""
    model_args = ",".join(
        [
            f"model={model}",
            f"base_url={server_url}/v1/completions",
            "tokenizer_backend=huggingface",
            f"tokenizer={tokenizer_dir}",
            "tokenized_requests=True",
            "num_concurrent=1",
            "max_retries=1",
        ]
    )
    return _run("local-completions", model_args, workdir, [], env={"OPENAI_API_KEY": api_key or ""})


def _run(
    model: str, model_args: str, workdir: Path, extra_args: list[str], env: dict[str, str]
) -> LmEvalResult:
    output = workdir / "lmeval-out"
    command = [
        sys.executable, "-m", "lm_eval", "run",
        "--model", model,
        "--model_args", model_args,
        "--tasks", TASK,
        "--include_path", str(TASK_DIR),
        "--batch_size", "1",
        "--log_samples",
        "--output_path", str(output),
        *extra_args,
    ]  # fmt: skip
    full_env = offline_hub_env(workdir, **env)
    run = subprocess.run(
        command, check=False, cwd=workdir, env=full_env, capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0, (
        f"lm-eval exited with {run.returncode}\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    )
    return read_output(output)


def read_output(output: Path) -> LmEvalResult:
    """The accuracy and per-choice loglikelihoods of the one run under ``output`` (lm-eval
    writes ``results_<time>.json`` and ``samples_<task>_<time>.jsonl`` under a folder named
    for the model)."""
    (results,) = output.glob("*/results_*.json")
    (samples,) = output.glob(f"*/samples_{TASK}_*.jsonl")
    accuracy = float(json.loads(results.read_text())["results"][TASK]["acc,none"])
    docs = {}
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        # resps: one entry per request (gen_args_0, 1, ...), each [[loglikelihood, is_greedy]],
        # the numbers as strings.
        loglikelihoods = tuple(float(resp[0][0]) for resp in sample["resps"])
        assert len(loglikelihoods) == len(sample["arguments"]), sample
        docs[int(sample["doc_id"])] = DocScores(
            target=int(sample["target"]), loglikelihoods=loglikelihoods
        )
    return LmEvalResult(accuracy=accuracy, docs=docs)


def argmax_accuracy(docs: dict[int, DocScores]) -> float:
    """The accuracy the loglikelihoods imply (the first of tied maxima wins, as in lm-eval)."""
    right = sum(
        max(range(len(d.loglikelihoods)), key=d.loglikelihoods.__getitem__) == d.target
        for d in docs.values()
    )
    return right / len(docs)


def assert_scores_every_choice_of_every_doc(result: LmEvalResult) -> None:
    """The ``hf`` run is whole: every document of the local task, one finite loglikelihood
    per choice, its target, and the accuracy their argmax makes."""
    questions = [
        json.loads(line) for line in (TASK_DIR / "questions.jsonl").read_text().splitlines()
    ]
    assert 0.0 <= result.accuracy <= 1.0
    assert sorted(result.docs) == list(range(len(questions)))
    for doc_id, doc in result.docs.items():
        assert len(doc.loglikelihoods) == len(questions[doc_id]["choices"]), doc_id
        assert all(math.isfinite(x) and x <= 0.0 for x in doc.loglikelihoods), doc
        assert doc.target == questions[doc_id]["answer"]
    assert result.accuracy == argmax_accuracy(result.docs)
