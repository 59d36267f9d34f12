"""``tokenpipe scheduler|detokenizer|api`` run one process each (as deploy/supervisord.conf
does), here over tcp:// endpoints, which is how they would span hosts."""

from __future__ import annotations

import subprocess

import httpx

from tests.server_harness import REPO, RoleProcesses, tokenpipe_command


def test_three_processes_over_tcp_serve_a_request() -> None:
    procs = RoleProcesses().wait_ready()
    try:
        out = httpx.post(
            f"{procs.url}/generate",
            json={"text": "over tcp", "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}},
            timeout=30,
        ).json()
        assert out["meta_info"]["completion_tokens"] == 5
    finally:
        codes = list(procs.stop().values())
    assert all(code in (0, -15) for code in codes), codes


def test_a_lone_process_needs_explicit_endpoints() -> None:
    run = subprocess.run(tokenpipe_command("scheduler"), check=False, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "--scheduler-input" in run.stderr
