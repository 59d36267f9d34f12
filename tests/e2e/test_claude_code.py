"""Claude Code (``@anthropic-ai/claude-code`` from npm, which ``make test`` installs) pointed at
the server as a user points it at a self-hosted model: ``ANTHROPIC_BASE_URL``, a key, and
``claude -p``. A recording proxy between them shows each request it made and the answer.

Claude Code asks for 32,000 tokens and takes an answer cut at a limit as an error, so the
model must end its turns by itself, as a real one does. The checkpoint is the small random one
made to: every embedding shares one large direction, so the last hidden state is nearly that
direction at every step, and the EOS row of ``lm_head`` points along it, giving EOS about a
tenth of the probability at each step (the answer is a few random tokens, now and then none).
Its context holds Claude Code's prompt (about 34,000 tokens).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.small_checkpoint import write
from pipeline.tokenizer_loader import SHIPPED_EOS_TOKEN_IDS
from tests.recording_proxy import RecordingProxy
from tests.server_harness import ServerProcess

MODEL = "claude-local"
KEY = "sk-local-test"
CLAUDE = Path(__file__).resolve().parents[2] / ".node" / "node_modules" / ".bin" / "claude"
EOS_LOGIT = 6.0  # against about 4,000 tokens near 0: EOS at about 9% a step


def _ending_checkpoint(directory: Path) -> None:
    """The small checkpoint (see the module docstring) with a long context."""
    shape = write(directory, layers=2, hidden=64, seed=5, max_position_embeddings=65536)
    weights = load_file(directory / "model.safetensors")
    shared = torch.zeros(shape.hidden_size)
    shared[0] = 1.0
    # Far above the rows' own norm (about 4): after the final RMSNorm the hidden state is
    # about sqrt(hidden) * shared whatever the context.
    weights["model.embed_tokens.weight"] += 40.0 * shared
    scale = EOS_LOGIT / shape.hidden_size**0.5
    for eos in SHIPPED_EOS_TOKEN_IDS:
        weights["lm_head.weight"][eos] = scale * shared
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("claude-code")
    _ending_checkpoint(directory / "model")
    args = [
        *("--model-path", str(directory / "model"), "--served-model-name", MODEL),
        *("--api-key", KEY, "--max-total-tokens", "131072"),
    ]
    srv = ServerProcess(directory / "tmp", args).wait_ready()
    yield srv
    srv.stop()


def _streamed_text(answer: bytes) -> str:
    """The text blocks of a streamed message, joined from its ``text_delta`` events."""
    text = []
    for line in answer.decode().splitlines():
        if line.startswith("data: "):
            event = json.loads(line[6:])
            if event["type"] == "content_block_delta" and event["delta"]["type"] == "text_delta":
                text.append(event["delta"]["text"])
    return "".join(text)


def _started_usage(answer: bytes) -> dict[str, int]:
    """The usage a streamed message starts with (the prompt's)."""
    for line in answer.decode().splitlines():
        if line.startswith("data: "):
            event = json.loads(line[6:])
            if event["type"] == "message_start":
                return dict(event["message"]["usage"])
    raise AssertionError("no message_start in the stream")


@pytest.mark.skipif(
    not CLAUDE.exists() and os.environ.get("CI") != "true",
    reason="Claude Code is not installed (`make node-deps` installs it with npm)",
)
def test_claude_code_completes_with_every_request_answered(
    server: ServerProcess, tmp_path: Path
) -> None:
    """It completes and prints the model's answer, twice; every request it made was answered
    200, its messages requests with Claude Code's own fields (tools, thinking, ...) as sent."""
    assert CLAUDE.exists(), f"{CLAUDE} is missing: `make node-deps` installs Claude Code"
    with RecordingProxy(server.url) as proxy:
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(tmp_path),
            "ANTHROPIC_BASE_URL": proxy.url,
            "ANTHROPIC_API_KEY": KEY,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }
        runs = []
        for _ in range(2):
            done = subprocess.run(
                [str(CLAUDE), "-p", "Say hello.", "--model", MODEL],
                env=env,
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert done.returncode == 0, (done.stdout, done.stderr)
            runs.append((done.stdout, len(proxy.exchanges)))
    exchanges = [(e.method, e.path, e.status) for e in proxy.exchanges]
    assert all(status == 200 for _, _, status in exchanges), exchanges
    for stdout, seen in runs:
        asked = [e for e in proxy.exchanges[:seen] if e.path.split("?")[0] == "/v1/messages"]
        assert asked, exchanges
        assert stdout.strip() == _streamed_text(bytes(asked[-1].answer)).strip()
    sent = json.loads(asked[-1].body)
    assert sent["model"] == MODEL and sent["stream"] is True and sent["tools"], sorted(sent)
    assert sent["max_tokens"] > 4096  # above the server's limit: capped, not refused
    # The second run's prompt is the first's (the billing header aside, which the server leaves
    # out: Claude Code may put a hash in it that changes per request), so nearly all of it
    # comes from the prefix cache.
    usage = _started_usage(bytes(asked[-1].answer))
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert usage["cache_read_input_tokens"] > 0.9 * prompt, usage
