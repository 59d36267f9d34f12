"""guidellm (the vLLM project's benchmark client, PyPI ``guidellm``, pinned in the test extra)
against a real server: its CLI runs a short concurrent benchmark with synthetic prompts, and
its JSON report must count every request as successful, with the output token counts asked.

guidellm streams by default and sends, on both OpenAI routes, ``model``, ``stream: true``,
``stream_options: {"include_usage": true, "continuous_usage_stats": true}``, ``ignore_eos:
true``, the prompt (``prompt``, or ``messages`` with content as a list of text parts) and the
token cap (``max_tokens`` on completions, ``max_completion_tokens`` on chat). Before that it
sends ``GET /health`` and ``GET /v1/models`` (the model is the first listed).

guidellm is skipped when missing, except under CI=true, where a missing client fails the
test instead."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.server_harness import REPO, ServerProcess, offline_hub_env

GUIDELLM_VERSION = "0.8.1"  # the CLI's syntax changes between releases: keep in step with pyproject
TOKENIZER_DIR = (
    REPO / "pipeline" / "assets"
)  # the server's default tokenizer, for the synthetic prompts
STREAMS = 4
REQUESTS = 32
PROMPT_TOKENS = 32  # guidellm's count; the server's may differ by a token at the cut
OUTPUT_TOKENS = 16


def require_guidellm() -> None:
    """Skips (or fails under CI=true) unless the pinned guidellm is installed."""
    try:
        found = importlib.metadata.version("guidellm")
    except importlib.metadata.PackageNotFoundError:
        found = None
    if found == GUIDELLM_VERSION:
        return
    message = f"guidellm=={GUIDELLM_VERSION} is not installed" + (
        f" (found {found})" if found else ""
    )
    if os.environ.get("CI") == "true":
        pytest.fail(message + " (CI=true: a missing client is a failure)")
    pytest.skip(message)


def run_guidellm(server: ServerProcess, request_format: str, workdir: Path) -> dict[str, Any]:
    """``guidellm run`` as a subprocess, offline; returns its one benchmark from the JSON report."""
    report = workdir / "benchmarks.json"
    command = [
        sys.executable, "-m", "guidellm", "run", "--backend",
        f"kind=openai_http,target={server.url},request_format={request_format}", "--profile",
        f"kind=concurrent,streams={STREAMS}", "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
        "--tokenizer", f"kind=huggingface_auto,model={TOKENIZER_DIR}", "--output",
        f"kind=json,path={report}", "--disable-console-interactive",
    ]  # fmt: skip
    env = offline_hub_env(
        workdir,
        GUIDELLM__MAX_WORKER_PROCESSES="2",  # its default, 10, is for a big client machine
        GUIDELLM__DEFAULT_RESULTS_DIR=str(workdir),
    )
    run = subprocess.run(
        command, check=False, cwd=workdir, env=env, capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0, (
        f"guidellm exited with {run.returncode}\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    )
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    return benchmark  # type: ignore[no-any-return]


def request_errors(benchmark: dict[str, Any]) -> list[str]:
    return [str(r["info"]["error"]) for r in benchmark["requests"]["errored"]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("request_format", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_concurrent_benchmark_succeeds_with_the_output_tokens_asked(
    server: ServerProcess, request_format: str, tmp_path: Path
) -> None:
    require_guidellm()
    benchmark = run_guidellm(server, request_format, tmp_path)
    totals = benchmark["metrics"]["request_totals"]
    assert totals["errored"] == 0, f"{totals}; first errors: {request_errors(benchmark)[:3]}"
    assert totals["incomplete"] == 0, totals
    assert totals["successful"] == REQUESTS, totals

    successful = benchmark["requests"]["successful"]
    assert len(successful) == REQUESTS
    for request in successful:
        sent = json.loads(request["request_args"])["body"]
        assert sent["stream"] is True and sent["ignore_eos"] is True, sent
        # ignore_eos: every request generates exactly the tokens it asked for.
        assert request["output_metrics"]["text_tokens"] == OUTPUT_TOKENS, request["output_metrics"]
        assert request["output"], "guidellm received no text"
        assert request["input_metrics"]["text_tokens"] > 0, request["input_metrics"]
        # Streamed: the tokens came in more than one SSE event.
        assert request["info"]["timings"]["token_iterations"] > 1, request["info"]["timings"]

    output_tokens = benchmark["metrics"]["output_token_count"]["successful"]
    assert output_tokens["count"] == REQUESTS
    assert output_tokens["min"] == output_tokens["max"] == OUTPUT_TOKENS
    assert output_tokens["total_sum"] == REQUESTS * OUTPUT_TOKENS
