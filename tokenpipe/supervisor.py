"""``tokenpipe serve``: starts the three processes, waits until each reports ready, and keeps
the service whole: any child exiting stops the others and the supervisor exits non-zero,
with a log line naming the child and its exit code, so the service is never left half
alive. SIGTERM/SIGINT stop it in order (``Supervisor.run``) and it exits 0."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import msgspec
import zmq

from pipeline.config import CONFIG_ENV, ServerConfig
from pipeline.io_struct import ProcessReady
from pipeline.process_util import IPC_DIR_ENV, METRICS_DIR_ENV, SUPERVISOR_PID_ENV
from pipeline.sockets import FrameDecoder, PrivateIpcDir, bind_pull

logger = logging.getLogger("tokenpipe.supervisor")

BACKENDS = ("scheduler", "detokenizer")
_STARTUP_TIMEOUT = 600.0
_STOP_TIMEOUT = 3.0


class Supervisor:
    """The children and their private ipc directory. Children run in their own process group
    (a terminal's Ctrl-C reaches only the supervisor, which then shuts down in order). The
    private ipc directory is removed on every exit path: by the supervisor, or, when it is
    SIGKILLed, by its children, which watch for their parent's death, remove the directory
    (named to them in the environment), and stop (``process_util.die_with_parent``)."""

    def __init__(self, config: ServerConfig) -> None:
        self.ipc = PrivateIpcDir()
        self.config = msgspec.structs.replace(
            config,
            scheduler_input=config.scheduler_input or self.ipc.endpoint("scheduler"),
            detokenizer_input=config.detokenizer_input or self.ipc.endpoint("detokenizer"),
            tokenizer_input=config.tokenizer_input or self.ipc.endpoint("tokenizer"),
            ready_endpoint=self.ipc.endpoint("ready"),
        )
        self.api_names = (
            ["api"] if config.api_workers == 1 else [f"api-{i}" for i in range(config.api_workers)]
        )
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        # A plain flag: setting a threading.Event from a signal handler can deadlock.
        self._stopping = False

    def run(self) -> int:
        """Until a child exits (1) or a signal comes (0). On SIGTERM/SIGINT the API processes
        are asked to stop first (uvicorn stops accepting and lets in-flight requests finish,
        bounded by --graceful-timeout), then the scheduler and the detokenizer."""
        started = time.monotonic()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        ctx = zmq.Context()
        try:
            ready = bind_pull(ctx, self.config.ready_endpoint or "")
            self._spawn_all()
            failed = self._wait_ready(ready)
            if failed is not None:
                return failed
            self._announce(time.monotonic() - started)
            while not self._stopping:
                dead = self._first_exited()
                if dead is not None:
                    return self._fail(*dead)
                time.sleep(0.1)
            logger.info(
                "shutting down: letting in-flight requests finish (up to %.0f s)",
                self.config.graceful_timeout,
            )
            self._stop_children(self.api_names, self.config.graceful_timeout + _STOP_TIMEOUT)
            self._stop_children(BACKENDS, _STOP_TIMEOUT)
            logger.info("stopped")
            return 0
        finally:
            self._kill_all()
            ctx.destroy(linger=0)
            self.ipc.close()

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._stopping = True

    def _spawn_all(self) -> None:
        """With ``--api-workers N`` there are N API processes (``api-0`` ... ``api-{N-1}``),
        each with its own index and frame socket, sharing the HTTP port through SO_REUSEPORT.
        Before starting them the port is bound once without SO_REUSEPORT, so a port that
        another server holds fails here rather than being silently shared. They share
        Prometheus metrics through a ``metrics`` directory inside the private ipc directory
        (``PROMETHEUS_MULTIPROC_DIR``), so any of them serves the totals of all."""
        # Through the environment, not argv: /proc/PID/cmdline is world-readable and the
        # config may hold the API key, while /proc/PID/environ is readable by the owner only.
        # The pid and the directory let a child clean up and stop when this process is killed.
        env = dict(
            os.environ,
            **{
                CONFIG_ENV: self.config.encode(),
                SUPERVISOR_PID_ENV: str(os.getpid()),
                IPC_DIR_ENV: str(self.ipc.path),
            },
        )
        if len(self.api_names) > 1:
            ensure_port_free(self.config.host, self.config.port)
        for name in BACKENDS:
            self.children[name] = subprocess.Popen(
                [sys.executable, "-m", "tokenpipe", name], env=env, process_group=0
            )
        api_env = dict(env)
        if len(self.api_names) > 1:
            if self.config.enable_metrics:
                metrics_dir = self.ipc.path / "metrics"
                metrics_dir.mkdir(mode=0o700)
                api_env[METRICS_DIR_ENV] = str(metrics_dir)
        for index, name in enumerate(self.api_names):
            api_env[CONFIG_ENV] = msgspec.structs.replace(
                self.config, api_worker_index=index
            ).encode()
            self.children[name] = subprocess.Popen(
                [sys.executable, "-m", "tokenpipe", "api"], env=api_env, process_group=0
            )

    def _wait_ready(self, sock: zmq.Socket) -> int | None:
        decoder: FrameDecoder[ProcessReady] = FrameDecoder(ProcessReady, logger, "ready")
        pending = set(self.children)
        deadline = time.monotonic() + _STARTUP_TIMEOUT
        while pending:
            if self._stopping:
                logger.info("interrupted during start-up")
                return 0
            dead = self._first_exited()
            if dead is not None:
                return self._fail(*dead)
            if time.monotonic() > deadline:
                logger.error(
                    "children %s did not report ready within %.0f s",
                    sorted(pending),
                    _STARTUP_TIMEOUT,
                )
                return 1
            if sock.poll(100):
                msg = decoder.decode(sock.recv())
                if msg is not None:
                    pending.discard(msg.name)
        return None

    def _announce(self, elapsed: float) -> None:
        c = self.config
        # Never print the key itself.
        auth = " -H 'Authorization: Bearer $TOKENPIPE_API_KEY'" if c.api_key else ""
        body = '{"text": "Hello", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}'
        print(
            f"tokenpipe ready on http://{c.host}:{c.port} in {elapsed:.1f} s. Try:\n"
            f"  curl -s http://{c.host}:{c.port}/generate{auth} "
            f"-H 'Content-Type: application/json' -d '{body}'",
            flush=True,
        )

    def _first_exited(self) -> tuple[str, int] | None:
        for name, proc in self.children.items():
            code = proc.poll()
            if code is not None:
                return name, code
        return None

    def _fail(self, name: str, code: int) -> int:
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        logger.error(
            "child process %s (pid %d) %s; stopping the service", name, self.children[name].pid, how
        )
        return 1

    def _stop_children(self, names: Sequence[str], timeout: float) -> None:
        """SIGTERM to all of them at once (API workers drain together), then a shared deadline."""
        for name in names:
            if self.children[name].poll() is None:
                self.children[name].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for name in names:
            proc = self.children[name]
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0f s; killing it", name, timeout)
                proc.kill()
                proc.wait()

    def _kill_all(self) -> None:
        """Every exit path: SIGTERM what is still alive, then SIGKILL after a short wait."""
        alive = [p for p in self.children.values() if p.poll() is None]
        for proc in alive:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + _STOP_TIMEOUT
        for proc in alive:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def ensure_port_free(host: str, port: int) -> None:
    """SystemExit when ``host:port`` is taken. The API workers bind it with SO_REUSEPORT,
    which another process of this user listening there with SO_REUSEPORT would not stop."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise SystemExit(
                f"the HTTP server could not start on {host}:{port}: {exc.strerror}"
            ) from None


def serve(config: ServerConfig) -> int:
    logger.info("starting tokenpipe (pid %d)", os.getpid())
    return Supervisor(config).run()
