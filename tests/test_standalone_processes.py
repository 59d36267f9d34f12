"""``tokenpipe scheduler|detokenizer|api`` run one process each (as deploy/supervisord.conf
does), here over tcp:// endpoints, which is how they would span hosts."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx

from tests.server_harness import REPO, free_port


def test_three_processes_over_tcp_serve_a_request() -> None:
    ports = [free_port() for _ in range(3)]
    http_port = free_port()
    endpoints = [
        "--scheduler-input", f"tcp://127.0.0.1:{ports[0]}",
        "--detokenizer-input", f"tcp://127.0.0.1:{ports[1]}",
        "--tokenizer-input", f"tcp://127.0.0.1:{ports[2]}",
    ]  # fmt: skip
    procs = [
        subprocess.Popen([sys.executable, "-m", "tokenpipe", role, *endpoints, "--port", str(http_port), "--log-level", "warning", "--max-total-tokens", "4096"], cwd=REPO)
        for role in ("scheduler", "detokenizer", "api")
    ]
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{http_port}/health_generate", timeout=30).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the three processes never served a request"
            assert all(p.poll() is None for p in procs)
            time.sleep(0.2)
        out = httpx.post(
            f"http://127.0.0.1:{http_port}/generate",
            json={"text": "over tcp", "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}},
            timeout=30,
        ).json()
        assert out["meta_info"]["completion_tokens"] == 5
    finally:
        for p in procs:
            p.terminate()
        codes = [p.wait(15) for p in procs]
    assert all(code in (0, -15) for code in codes), codes


def test_a_lone_process_needs_explicit_endpoints() -> None:
    run = subprocess.run([sys.executable, "-m", "tokenpipe", "scheduler"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "--scheduler-input" in run.stderr
