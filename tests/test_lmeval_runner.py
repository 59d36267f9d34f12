"""tests/lmeval_runner.py against lm-eval's ``hf`` model on a small random checkpoint: the
task loads from its local files, offline, and every document comes back with one finite
loglikelihood per choice. The ``local-completions`` side needs the server's echo and
logprobs."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.small_checkpoint import write
from tests.lmeval_runner import TASK_DIR, argmax_accuracy, require_lm_eval, run_hf


def test_hf_model_scores_every_choice_of_every_doc(tmp_path: Path) -> None:
    require_lm_eval()
    checkpoint = tmp_path / "checkpoint"
    write(checkpoint, layers=2, hidden=128, seed=0)
    questions = [json.loads(line) for line in (TASK_DIR / "questions.jsonl").read_text().splitlines()]

    result = run_hf(checkpoint, tmp_path)

    assert 0.0 <= result.accuracy <= 1.0
    assert sorted(result.docs) == list(range(len(questions)))
    for doc_id, doc in result.docs.items():
        assert len(doc.loglikelihoods) == len(questions[doc_id]["choices"]), doc_id
        assert all(math.isfinite(x) and x <= 0.0 for x in doc.loglikelihoods), doc
        assert doc.target == questions[doc_id]["answer"]
    assert result.accuracy == argmax_accuracy(result.docs)
