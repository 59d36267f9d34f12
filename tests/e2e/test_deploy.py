"""The deploy/ kit against real components: supervisord (from PyPI) runs the
``tokenpipe`` console script (pyproject.toml's entry point, written as pip writes it) from
deploy/supervisord.conf, deploy/supervisord-serve.conf,
deploy/supervisord-pd.conf and deploy/supervisord-replicas.conf (with the real sglang-router
in front) in a private temporary run directory; promtool checks deploy/prometheus.yml and the
dashboard's PromQL; the dashboard's metric names are checked against a live /metrics.

promtool, supervisord and sglang-router are skipped when missing, except under CI=true, where
a missing tool fails the test instead."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.server_harness import (
    SMALL_SERVER_ARGS,
    REPO,
    ServerProcess,
    descendants,
    free_port,
    pid_alive,
    wait_until,
)
from tests.sglang_router import router_binary

DEPLOY = REPO / "deploy"
BIN = Path(sys.executable).parent  # the venv's scripts: supervisord, supervisorctl
DASHBOARD = DEPLOY / "grafana" / "tokenpipe-dashboard.json"
GENERATE = {
    "text": "supervised",
    "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
}


def write_console_script(directory: Path) -> Path:
    """``directory/tokenpipe``: the console script pip would install for pyproject.toml's
    ``[project.scripts] tokenpipe`` entry point. Written here rather than taken from the venv,
    whose script follows whichever checkout the (possibly shared) editable install names."""
    entry = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["tokenpipe"]
    module, function = entry.split(":")
    script = directory / "tokenpipe"
    script.write_text(
        f"#!{sys.executable}\nimport sys\nfrom {module} import {function}\nsys.exit({function}())\n"
    )
    script.chmod(0o755)
    return script


def require_tool(path: Path | str | None, what: str) -> Path:
    """The tool's path; a missing tool skips the test, or fails it under CI=true."""
    if path is not None and Path(path).exists():
        return Path(path)
    message = f"{what} is not installed"
    if os.environ.get("CI") == "true":
        pytest.fail(message + " (CI=true: a missing tool is a failure)")
    pytest.skip(message)


class Supervisord:
    """``supervisord -n`` on one of the deploy configs, with TOKENPIPE_* pointing at a
    private temporary run directory and a free port (TOKENPIPE_PORT, plus one for each
    variable in ``port_vars``: a PD deployment has three servers), and ``env`` on top."""

    def __init__(
        self, conf: str, port_vars: tuple[str, ...] = (), env: dict[str, str] | None = None
    ) -> None:
        self.supervisord = require_tool(BIN / "supervisord", "supervisord (pip install supervisor)")
        self.supervisorctl = require_tool(
            BIN / "supervisorctl", "supervisorctl (pip install supervisor)"
        )
        self.conf = DEPLOY / conf
        # Short (ipc socket paths are limited to ~107 bytes) and mode 0700, as the config asks.
        self.run_dir = Path(tempfile.mkdtemp(prefix="tp-deploy-"))
        self.port = free_port()
        self.ports = {name: free_port() for name in port_vars}
        self.env = dict(
            os.environ,
            TOKENPIPE_BIN=str(write_console_script(self.run_dir)),
            TOKENPIPE_RUN_DIR=str(self.run_dir),
            TOKENPIPE_PORT=str(self.port),
            TOKENPIPE_ARGS=shlex.join(SMALL_SERVER_ARGS),
            # The tokenpipe script imports the installed package, which may be another checkout
            # (an editable install shared by worktrees), while the children it starts run
            # `python -m tokenpipe` from this directory: both run this checkout.
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            **{name: str(port) for name, port in self.ports.items()},
            **(env or {}),
        )
        self._out = open(self.run_dir / "supervisord.out", "wb")
        self.proc = subprocess.Popen(
            [str(self.supervisord), "-c", str(self.conf), "-n"],
            env=self.env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.supervisorctl), "-c", str(self.conf), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=90,
        )

    def pid(self, program: str) -> int:
        out = self.ctl("pid", program).stdout.strip()
        return int(out) if out.isdigit() else 0

    def states(self) -> dict[str, str]:
        lines = self.ctl("status").stdout.splitlines()
        return {line.split()[0]: line.split()[1] for line in lines if len(line.split()) >= 2}

    def logs(self) -> str:
        parts = []
        for path in sorted(self.run_dir.glob("*.log")) + [self.run_dir / "supervisord.out"]:
            try:
                parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
            except OSError:
                pass
        return "\n".join(parts)

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (
                f"supervisord exited with {self.proc.returncode}\n{self.logs()}"
            )
            try:
                if httpx.get(self.url + "/health_generate", timeout=30).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"/health_generate never returned 200\n{self.logs()}")

    def generate(self) -> dict[str, Any]:
        r = httpx.post(self.url + "/generate", json=GENERATE, timeout=60)
        assert r.status_code == 200, f"{r.status_code} {r.text}\n{self.logs()}"
        out = r.json()
        assert out["meta_info"]["completion_tokens"] == 5
        return out

    def wait_generate(self, timeout: float) -> dict[str, Any]:
        """The first 200 answer to GENERATE; errors while the service (re)starts are retried."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (
                f"supervisord exited with {self.proc.returncode}\n{self.logs()}"
            )
            try:
                r = httpx.post(self.url + "/generate", json=GENERATE, timeout=60)
            except httpx.HTTPError as exc:
                last = repr(exc)
            else:
                if r.status_code == 200:
                    out = r.json()
                    assert out["meta_info"]["completion_tokens"] == 5, out
                    return out
                last = f"{r.status_code} {r.text[:500]}"
            time.sleep(0.2)
        raise AssertionError(
            f"/generate never answered 200 within {timeout:g} s; last: {last}\n{self.logs()}"
        )

    def tokenpipe_processes(self) -> list[int]:
        """Live processes of this service: a command line naming its run directory (ipc
        endpoints) or one of its ports, or an environment naming its run directory (every
        program inherits TOKENPIPE_RUN_DIR from supervisord, and serve's children get their
        config, ipc dir included, through the environment, not argv)."""
        run_dir = str(self.run_dir).encode()
        ports = {str(port).encode() for port in (self.port, *self.ports.values())}
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in (os.getpid(), self.proc.pid):
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            named = (
                run_dir in cmdline
                or run_dir in environ
                or not ports.isdisjoint(cmdline.split(b"\0"))
            )
            if named and pid_alive(int(entry.name)):
                found.append(int(entry.name))
        return found

    def close(self) -> None:
        """Whatever a test left: shut supervisord down, then kill any process of ours."""
        if self.proc.poll() is None:
            self.ctl("shutdown")
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.tokenpipe_processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._out.close()
        subprocess.run(["rm", "-rf", str(self.run_dir)], check=False)


@pytest.fixture
def supervisord_factory():  # type: ignore[no-untyped-def]
    started: list[Supervisord] = []

    def start(
        conf: str, port_vars: tuple[str, ...] = (), env: dict[str, str] | None = None
    ) -> Supervisord:
        sd = Supervisord(conf, port_vars, env)
        started.append(sd)
        return sd

    yield start
    for sd in started:
        sd.close()


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


PROGRAMS = ("tokenpipe-scheduler", "tokenpipe-detokenizer", "tokenpipe-api")


@pytest.mark.timeout(240)
def test_supervisord_three_programs_serve_restart_a_killed_scheduler_and_stop_clean(
    supervisord_factory,
) -> None:  # type: ignore[no-untyped-def]
    sd = supervisord_factory("supervisord.conf")
    sd.wait_healthy()
    sd.generate()
    # Serving can come before supervisord's startsecs (2 s) has passed: wait for RUNNING.
    assert wait_until(lambda: sd.states() == dict.fromkeys(PROGRAMS, "RUNNING"), 15, 0.2), (
        f"{sd.states()}\n{sd.logs()}"
    )
    pids = {name: sd.pid(name) for name in PROGRAMS}
    assert all(pids.values()), pids
    assert (sd.run_dir.stat().st_mode & 0o777) == 0o700
    for name in ("scheduler", "detokenizer", "tokenizer"):
        assert (sd.run_dir / name).is_socket(), f"no ipc socket {name} in the run dir"

    # Every metric the dashboard queries exists on the live /metrics.
    metrics = httpx.get(sd.url + "/metrics", timeout=30).text
    exposed = set(re.findall(r"^(tokenpipe:[A-Za-z0-9_]+)", metrics, re.M))
    wanted = {
        name for expr in dashboard_exprs() for name in re.findall(r"tokenpipe:[A-Za-z0-9_]+", expr)
    }
    assert wanted <= exposed, (
        f"the dashboard queries metrics /metrics lacks: {sorted(wanted - exposed)}"
    )

    # SIGKILL the scheduler: supervisord starts a new one, the API and the detokenizer keep
    # their sockets (their PUSH sides reconnect), and requests sent afterwards get through.
    os.kill(pids["tokenpipe-scheduler"], signal.SIGKILL)
    assert wait_until(
        lambda: sd.pid("tokenpipe-scheduler") not in (0, pids["tokenpipe-scheduler"]), 30, 0.2
    ), sd.logs()
    assert "exited: tokenpipe-scheduler (terminated by SIGKILL; not expected)" in sd.logs()
    sd.wait_healthy(60)
    sd.generate()
    sd.generate()
    assert sd.pid("tokenpipe-api") == pids["tokenpipe-api"]
    assert sd.pid("tokenpipe-detokenizer") == pids["tokenpipe-detokenizer"]
    pids["tokenpipe-scheduler"] = sd.pid("tokenpipe-scheduler")

    stop = sd.ctl("stop", "all")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert wait_until(lambda: not sd.tokenpipe_processes(), 15), (
        f"left behind: {sd.tokenpipe_processes()}\n{sd.logs()}"
    )
    assert not any(pid_alive(pid) for pid in pids.values())
    assert sd.ctl("shutdown").returncode == 0
    assert sd.proc.wait(30) == 0


@pytest.mark.timeout(240)
def test_supervisord_shutdown_stops_the_api_first_and_in_flight_requests_finish(
    supervisord_factory,
) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM to supervisord stops programs one by one, highest priority first: the API
    drains while the scheduler and the detokenizer still run."""
    sd = supervisord_factory("supervisord.conf")
    sd.wait_healthy()
    body = {
        "text": "drain",
        "stream": True,
        "sampling_params": {"max_new_tokens": 150, "temperature": 0, "ignore_eos": True},
    }
    events: list[dict[str, Any]] = []
    done = False
    with httpx.stream("POST", sd.url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            events.append(json.loads(line[len("data: ") :]))
            if len(events) == 1:
                sd.proc.send_signal(signal.SIGTERM)
    assert done, sd.logs()
    assert events[-1]["meta_info"]["completion_tokens"] == 150
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert sd.proc.wait(60) == 0, sd.logs()
    log = (sd.run_dir / "supervisord.log").read_text()
    stopped = [
        log.index(f"stopped: {name}")
        for name in ("tokenpipe-api", "tokenpipe-detokenizer", "tokenpipe-scheduler")
    ]
    assert stopped == sorted(stopped), log
    assert wait_until(lambda: not sd.tokenpipe_processes(), 15), (
        f"left behind: {sd.tokenpipe_processes()}"
    )


@pytest.mark.timeout(240)
def test_supervisord_serve_variant_restarts_when_a_child_dies_and_stops_clean(
    supervisord_factory,
) -> None:  # type: ignore[no-untyped-def]
    sd = supervisord_factory("supervisord-serve.conf")
    sd.wait_healthy()
    sd.generate()
    serve_pid = sd.pid("tokenpipe")
    children = {role: pid for pid, role in descendants(serve_pid).items() if role}
    assert set(children) == {"scheduler", "detokenizer", "api"}, children
    ipc_dirs = list(sd.run_dir.glob("tokenpipe-*"))
    assert len(ipc_dirs) == 1 and ipc_dirs[0].is_dir(), (
        "serve makes its private ipc dir under TMPDIR (the run dir)"
    )

    # A killed child makes `tokenpipe serve` stop the others and exit non-zero; supervisord
    # starts it again and the service serves again.
    os.kill(children["scheduler"], signal.SIGKILL)
    assert wait_until(lambda: sd.pid("tokenpipe") not in (0, serve_pid), 30, 0.2), sd.logs()
    assert "exited: tokenpipe (exit status 1; not expected)" in sd.logs()
    assert wait_until(lambda: not any(pid_alive(p) for p in [serve_pid, *children.values()]), 10)
    assert not ipc_dirs[0].exists(), "the dead service's ipc dir was left behind"
    sd.wait_healthy(60)
    sd.generate()

    stop = sd.ctl("stop", "all")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert wait_until(lambda: not sd.tokenpipe_processes(), 15), (
        f"left behind: {sd.tokenpipe_processes()}\n{sd.logs()}"
    )
    assert not list(sd.run_dir.glob("tokenpipe-*")), "ipc dir left behind"
    assert sd.ctl("shutdown").returncode == 0
    assert sd.proc.wait(30) == 0


PD_PROGRAMS = ("tokenpipe-prefill", "tokenpipe-decode", "sglang-router")
PD_PORTS = (
    "TOKENPIPE_PREFILL_PORT",
    "TOKENPIPE_DECODE_PORT",
    "TOKENPIPE_BOOTSTRAP_PORT",
    "TOKENPIPE_ROUTER_METRICS_PORT",
)


@pytest.mark.timeout(300)
def test_supervisord_pd_pair_matches_unified_survives_prefill_kill(  # type: ignore[no-untyped-def]
    server: ServerProcess, supervisord_factory
) -> None:
    """A PD pair behind sglang-router, run by supervisord, answers as the unified server
    does, restarts a killed prefill server and stops clean."""
    sd = supervisord_factory(
        "supervisord-pd.conf",
        PD_PORTS,
        {
            "TOKENPIPE_SGLANG_ROUTER_BIN": router_binary(),
            "TOKENPIPE_SGLANG_ROUTER_ARGS": "--log-level warn",
        },
    )
    with server.client() as unified:
        expected = unified.post("/generate", json=GENERATE).json()["output_ids"]
    assert sd.wait_generate(180)["output_ids"] == expected
    assert wait_until(lambda: sd.states() == dict.fromkeys(PD_PROGRAMS, "RUNNING"), 15, 0.2), (
        f"{sd.states()}\n{sd.logs()}"
    )
    pids = {name: sd.pid(name) for name in PD_PROGRAMS}
    assert all(pids.values()), pids
    prefill_children = [pid for pid, role in descendants(pids["tokenpipe-prefill"]).items() if role]
    assert len(prefill_children) == 3, prefill_children
    ipc_dirs = [path for path in sd.run_dir.glob("tokenpipe-*") if path.is_dir()]
    assert len(ipc_dirs) == 2, "each serve makes its private ipc dir under TMPDIR (the run dir)"

    # SIGKILL the prefill server's `tokenpipe serve`: its children die with it, supervisord
    # starts it again, and sglang-router (and the decode server's KV fetches) reach it again.
    os.kill(pids["tokenpipe-prefill"], signal.SIGKILL)
    assert wait_until(
        lambda: sd.pid("tokenpipe-prefill") not in (0, pids["tokenpipe-prefill"]), 30, 0.2
    ), sd.logs()
    assert "exited: tokenpipe-prefill (terminated by SIGKILL; not expected)" in sd.logs()
    assert wait_until(lambda: not any(pid_alive(pid) for pid in prefill_children), 10), (
        prefill_children
    )
    assert sd.wait_generate(60)["output_ids"] == expected
    assert sd.pid("tokenpipe-decode") == pids["tokenpipe-decode"]
    assert sd.pid("sglang-router") == pids["sglang-router"]
    pids["tokenpipe-prefill"] = sd.pid("tokenpipe-prefill")
    # sglang-router retitles itself ("sglang::router"), which overwrites the command line and
    # environment that tokenpipe_processes() reads: it is followed by its pid instead.
    router = pids.pop("sglang-router")
    every = sd.tokenpipe_processes()
    assert set(pids.values()) <= set(every) and len(every) == 8, (
        f"two servers with three children each: {every}"
    )

    stop = sd.ctl("stop", "all")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert wait_until(lambda: not sd.tokenpipe_processes() and not pid_alive(router), 15), (
        f"left behind: {sd.tokenpipe_processes()}\n{sd.logs()}"
    )
    assert sd.ctl("shutdown").returncode == 0
    assert sd.proc.wait(30) == 0


REPLICA_PROGRAMS = ("tokenpipe-replica1", "tokenpipe-replica2", "sglang-router")
REPLICA_PORTS = (
    "TOKENPIPE_REPLICA1_PORT",
    "TOKENPIPE_REPLICA2_PORT",
    "TOKENPIPE_ROUTER_METRICS_PORT",
)


def replica_ports(sd: Supervisord) -> dict[str, int]:
    return {
        "tokenpipe-replica1": sd.ports["TOKENPIPE_REPLICA1_PORT"],
        "tokenpipe-replica2": sd.ports["TOKENPIPE_REPLICA2_PORT"],
    }


def requests_served(port: int) -> int:
    """A replica's ``tokenpipe:num_requests_total``, streaming and not."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    return int(
        sum(
            float(v)
            for v in re.findall(
                r"^tokenpipe:num_requests_total\{[^}]*\} (\S+)$", text, re.MULTILINE
            )
        )
    )


def one_request_on_each_replica(sd: Supervisord) -> bool:
    """Holds a stream open through the router while a second request goes through, and says
    whether each replica served one of the two. Random prompts match nothing the router's
    cache-aware map has seen, so it picks the replica with fewer requests in flight: with both
    replicas in its rotation, the second request goes where the stream is not."""
    ports = replica_ports(sd).values()
    before = [requests_served(port) for port in ports]
    held = {
        "text": uuid.uuid4().hex,
        "stream": True,
        "sampling_params": {"max_new_tokens": 64, "ignore_eos": True},
    }
    second = {
        "text": uuid.uuid4().hex,
        "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
    }
    with httpx.stream("POST", sd.url + "/generate", json=held, timeout=60) as stream:
        if stream.status_code != 200:
            return False
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # in flight on its replica now
        answered = httpx.post(sd.url + "/generate", json=second, timeout=60).status_code == 200
        finished = "data: [DONE]" in list(lines)
    after = [requests_served(port) for port in ports]
    return answered and finished and all(a > b for a, b in zip(after, before))


@pytest.mark.timeout(300)
def test_supervisord_replicas_share_survive_a_kill_and_drain(  # type: ignore[no-untyped-def]
    supervisord_factory,
) -> None:
    """Replicas behind sglang-router, run by supervisord, share the requests, survive a killed
    replica and drain on shutdown."""
    sd = supervisord_factory(
        "supervisord-replicas.conf",
        REPLICA_PORTS,
        {
            "TOKENPIPE_SGLANG_ROUTER_BIN": router_binary(),
            "TOKENPIPE_SGLANG_ROUTER_ARGS": "--log-level warn",
        },
    )
    sd.wait_generate(180)
    assert wait_until(lambda: sd.states() == dict.fromkeys(REPLICA_PROGRAMS, "RUNNING"), 15, 0.2), (
        f"{sd.states()}\n{sd.logs()}"
    )
    ports = replica_ports(sd)
    # The model the replicas serve: the router passes the request's model on.
    model = httpx.get(
        f"http://127.0.0.1:{ports['tokenpipe-replica1']}/v1/models", timeout=30
    ).json()["data"][0]["id"]
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": "replicas"}],
        "max_tokens": 5,
        "temperature": 0,
    }
    r = httpx.post(sd.url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, f"{r.status_code} {r.text}\n{sd.logs()}"
    assert r.json()["usage"]["completion_tokens"] == 5
    assert wait_until(lambda: one_request_on_each_replica(sd), 30, 0.2), sd.logs()
    pids = {name: sd.pid(name) for name in REPLICA_PROGRAMS}
    assert all(pids.values()), pids

    # SIGKILL the replica the router sends a lone request to (with nothing in flight it picks
    # the same one each time): its children die with it, supervisord starts it again, and the
    # router keeps serving. The first requests it still sends to the dead replica may fail
    # (see the config's comments): wait_generate retries those; then requests in a row get
    # through, and the restarted replica gets its share again.
    before = {name: requests_served(port) for name, port in ports.items()}
    sd.generate()
    (favoured,) = [name for name, port in ports.items() if requests_served(port) > before[name]]
    (other,) = set(ports) - {favoured}
    children = [pid for pid, role in descendants(pids[favoured]).items() if role]
    assert len(children) == 3, children
    os.kill(pids[favoured], signal.SIGKILL)
    assert wait_until(lambda: sd.pid(favoured) not in (0, pids[favoured]), 30, 0.2), sd.logs()
    assert f"exited: {favoured} (terminated by SIGKILL; not expected)" in sd.logs()
    assert wait_until(lambda: not any(pid_alive(pid) for pid in children), 10), children
    sd.wait_generate(60)
    for _ in range(5):
        sd.generate()
    assert sd.pid(other) == pids[other]
    assert sd.pid("sglang-router") == pids["sglang-router"]
    assert wait_until(lambda: one_request_on_each_replica(sd), 120, 1.0), sd.logs()

    # SIGTERM to supervisord stops the router first, which lets a stream in flight finish,
    # then the replicas; nothing is left behind.
    body = {
        "text": uuid.uuid4().hex,
        "stream": True,
        "sampling_params": {"max_new_tokens": 150, "ignore_eos": True},
    }
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", sd.url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == "data: [DONE]":
                break
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
                if len(events) == 1:
                    sd.proc.send_signal(signal.SIGTERM)
        else:
            raise AssertionError(f"the stream ended without [DONE]\n{sd.logs()}")
    assert events[-1]["meta_info"]["completion_tokens"] == 150
    assert sd.proc.wait(90) == 0, sd.logs()
    log = (sd.run_dir / "supervisord.log").read_text()
    stopped = [
        log.index(f"stopped: {name}")
        for name in ("sglang-router", "tokenpipe-replica2", "tokenpipe-replica1")
    ]
    assert stopped == sorted(stopped), log
    assert wait_until(lambda: not sd.tokenpipe_processes(), 15), (
        f"left behind: {sd.tokenpipe_processes()}\n{sd.logs()}"
    )


def test_prometheus_config_passes_promtool() -> None:
    promtool = require_tool(shutil.which("promtool"), "promtool (apt-get install prometheus)")
    run = subprocess.run(
        [str(promtool), "check", "config", str(DEPLOY / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "tokenpipe"]
    assert job["scrape_interval"] == "5s" and job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert "localhost:30000" in targets and "host.docker.internal:30000" in targets


def test_dashboard_panels_query_tokenpipe_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert 36 <= dash["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource"
        and variables["datasource"]["query"] == "prometheus"
    )
    assert "model_name" in variables
    assert dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        exprs = [t.get("expr", "") for t in panel.get("targets", [])]
        assert any("tokenpipe:" in e for e in exprs), (
            f"panel {panel['title']!r} queries no tokenpipe metric"
        )
        assert panel["datasource"]["uid"] == "${datasource}"
        for expr in exprs:
            assert 'model_name=~"$model_name"' in expr, (
                f"panel {panel['title']!r}: {expr} does not filter by model"
            )
    joined = "\n".join(dashboard_exprs())
    for needed in (
        "tokenpipe:time_to_first_token_seconds_bucket",
        "tokenpipe:inter_token_latency_seconds_bucket",
        "tokenpipe:e2e_request_latency_seconds_bucket",
        "tokenpipe:queue_time_seconds_bucket",
        "tokenpipe:generation_tokens_total",
        "tokenpipe:prompt_tokens_total",
        "tokenpipe:gen_throughput",
        "tokenpipe:cache_hit_rate",
        'cache_source="total"',
        "tokenpipe:num_retracted_requests_total",
        "tokenpipe:num_retractions_bucket",
        "tokenpipe:num_running_reqs",
        "tokenpipe:num_queue_reqs",
        "tokenpipe:token_usage",
    ):
        assert needed in joined, needed
    for q in ("0.5", "0.9", "0.99"):
        assert (
            f"histogram_quantile({q}, sum by (le) "
            "(rate(tokenpipe:time_to_first_token_seconds_bucket" in joined
        )


def test_dashboard_promql_parses(tmp_path: Path) -> None:
    """promtool parses each panel query as a recording rule (Grafana's variables filled in)."""
    promtool = require_tool(shutil.which("promtool"), "promtool (apt-get install prometheus)")
    rules = [
        {
            "record": f"tokenpipe_dashboard:query_{i}",
            "expr": expr.replace("$__rate_interval", "1m").replace("$model_name", ".*"),
        }
        for i, expr in enumerate(dashboard_exprs())
    ]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run = subprocess.run(
        [str(promtool), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_compose_file_has_jaeger_and_prometheus() -> None:
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    services = compose["services"]

    def container_ports(service: dict[str, Any]) -> set[int]:
        return {int(str(p).split("/")[0].rsplit(":", 1)[-1]) for p in service.get("ports", [])}

    assert {4317, 4318, 16686} <= container_ports(services["jaeger"])
    assert "jaeger" in services["jaeger"]["image"]
    prom = services["prometheus"]
    assert 9090 in container_ports(prom)
    assert "host.docker.internal:host-gateway" in prom["extra_hosts"]
    # deploy/prometheus.yml is mounted where Prometheus reads its config.
    mounts = {src: dst for src, dst, *_ in (str(v).split(":") for v in prom["volumes"])}
    assert (DEPLOY / "prometheus.yml").exists() and "./prometheus.yml" in mounts
    config_flags = [c for c in prom.get("command", []) if c.startswith("--config.file=")]
    assert config_flags in ([], ["--config.file=/etc/prometheus/prometheus.yml"])
    assert mounts["./prometheus.yml"] == "/etc/prometheus/prometheus.yml"
