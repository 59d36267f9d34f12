"""``tokenpipe scheduler|detokenizer|api`` run one process each (as deploy/supervisord.conf
does), here over tcp:// endpoints, which is how they would span hosts."""

from __future__ import annotations

import subprocess

import httpx

from tests.server_harness import REPO, RoleProcesses, tokenpipe_command, wait_until


def test_three_processes_over_tcp_serve_a_request() -> None:
    procs = RoleProcesses().wait_ready()
    try:
        out = httpx.post(
            f"{procs.url}/generate",
            json={
                "text": "over tcp",
                "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
            },
            timeout=30,
        ).json()
        assert out["meta_info"]["completion_tokens"] == 5
    finally:
        codes = list(procs.stop().values())
    assert all(code in (0, -15) for code in codes), codes


def test_health_and_models_answer_503_until_the_pipeline_behind_the_api_is_up() -> None:
    """The API alone listens but serves nothing: /health and /v1/models say so (503, as
    SGLang's /health during start-up), so a router or load balancer sends it no traffic. Once
    the scheduler's report reaches it through the detokenizer, both answer 200."""
    procs = RoleProcesses(roles=("api",))
    try:

        def listening() -> bool:
            try:
                return httpx.get(f"{procs.url}/health", timeout=5).status_code > 0
            except httpx.TransportError:
                return False

        assert wait_until(listening, 60), "the API never listened"
        for path in ("/health", "/v1/models"):
            resp = httpx.get(procs.url + path, timeout=5)
            assert resp.status_code == 503, (path, resp.text)
            assert resp.json()["error"]["type"] == "service_unavailable", resp.text
        for role in ("detokenizer", "scheduler"):
            procs.procs[role] = procs.start(role)
        procs.wait_ready()
        assert httpx.get(procs.url + "/health", timeout=5).status_code == 200
        assert (
            httpx.get(procs.url + "/v1/models", timeout=5).json()["data"][0]["id"]
            == "tokenpipe-tiny"
        )
    finally:
        procs.stop()


def test_a_lone_process_needs_explicit_endpoints() -> None:
    run = subprocess.run(
        tokenpipe_command("scheduler"),
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "--scheduler-input" in run.stderr
