"""tests/lmeval_runner.py against lm-eval's ``hf`` model on a small random checkpoint: the
task loads from its local files, offline, and every document comes back with one finite
loglikelihood per choice. The ``local-completions`` side needs the server's echo and
logprobs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench.small_checkpoint import write
from tests.lmeval_runner import TASK_DIR, argmax_accuracy, require_lm_eval, run_hf, run_local_completions


def _assert_scores_every_choice_of_every_doc(result: Any) -> None:
    """The ``hf`` run is whole: every document of the local task, one finite loglikelihood
    per choice, its target, and the accuracy their argmax makes."""
    questions = [json.loads(line) for line in (TASK_DIR / "questions.jsonl").read_text().splitlines()]
    assert 0.0 <= result.accuracy <= 1.0
    assert sorted(result.docs) == list(range(len(questions)))
    for doc_id, doc in result.docs.items():
        assert len(doc.loglikelihoods) == len(questions[doc_id]["choices"]), doc_id
        assert all(math.isfinite(x) and x <= 0.0 for x in doc.loglikelihoods), doc
        assert doc.target == questions[doc_id]["answer"]
    assert result.accuracy == argmax_accuracy(result.docs)


def test_local_completions_against_tokenpipe_equals_the_hf_model(tmp_path: Path) -> None:
    """lm-eval's multiple-choice evaluation through tokenpipe's /v1/completions (echo with
    logprobs, token-id prompts, as ``local-completions`` sends them) and through its own
    ``hf`` model on the same checkpoint: the same accuracy, each choice's loglikelihood
    within 1e-3. (One ``hf`` run serves as the reference and as the check of the runner.)"""
    from tests.server_harness import ServerProcess

    require_lm_eval()
    checkpoint = tmp_path / "checkpoint"
    write(checkpoint, layers=2, hidden=128, seed=0)
    (tmp_path / "hf").mkdir()
    (tmp_path / "served").mkdir()
    reference = run_hf(checkpoint, tmp_path / "hf")
    _assert_scores_every_choice_of_every_doc(reference)
    server = ServerProcess(tmp_path / "srv", ["--model-path", str(checkpoint)]).wait_ready()
    try:
        import httpx

        model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        served = run_local_completions(server.url, checkpoint, tmp_path / "served", model=model)
    finally:
        server.stop()
    assert served.accuracy == reference.accuracy
    assert sorted(served.docs) == sorted(reference.docs)
    for doc_id, doc in served.docs.items():
        assert doc.loglikelihoods == pytest.approx(reference.docs[doc_id].loglikelihoods, abs=1e-3), doc_id
