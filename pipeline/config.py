"""The one typed configuration object every process receives.

Command-line flags and the ``OTEL_*`` variables are read here, once, into a
``ServerConfig``; nothing deeper in the code reads ``os.environ`` or ``argv``. The
supervisor hands each child the same object as JSON (in ``TOKENPIPE_CONFIG_JSON``), so the three
processes can never disagree about a setting.
"""

from __future__ import annotations

import argparse
import os
from typing import Literal

import msgspec

from pipeline.io_struct import MAX_API_WORKERS

Mode = Literal["generate", "embedding", "dllm"]
DisaggregationMode = Literal["null", "prefill", "decode"]

# The supervisor hands its children the whole config as JSON in this variable.
CONFIG_ENV = "TOKENPIPE_CONFIG_JSON"


class ServerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Model
    model_path: str | None = None
    served_model_name: str | None = None
    model_seed: int = 0
    device: str = "auto"
    torch_threads: int | None = None  # None: all cores but two (the other processes need them)
    mode: Mode = "generate"
    context_length: int | None = None  # None: the model's max_position_embeddings
    skip_tokenizer_init: bool = False  # token ids in, token ids out: no process loads a tokenizer

    # Scheduler
    max_total_tokens: int = 32768
    max_running_requests: int = 256
    chunked_prefill_size: int = 512
    stream_interval: int = 1
    max_new_tokens_limit: int = 4096
    discard_output: bool = False  # benchmarking only: build token frames, never send them
    dense_usage_columns: bool = False  # UsageColumns on every BatchTokenIDOutput row (docs/wire.md)
    dllm_block_size: int = 4  # --mode dllm: masked positions refined together, emitted as one row
    dllm_steps: int = 4  # --mode dllm: batched refinement passes per block

    # HiCache: a host tier under the device KV pool, and a storage tier under that
    hicache_host_tokens: int = 0  # 0: off
    hicache_storage_dir: str | None = None  # absolute path; storage can also be attached at runtime

    # PD disaggregation: a prefill server sends each request's KV to a decode server
    disaggregation_mode: DisaggregationMode = "null"  # null: one unified server
    disaggregation_bootstrap_port: int = 8998  # prefill: where decode servers fetch KV (tcp, on --host)
    disaggregation_bootstrap_endpoint: str | None = None  # prefill: a tcp:// or ipc:// endpoint instead of the port
    disaggregation_bootstrap_timeout: float = 30.0  # decode: wait for KV; prefill: how long unclaimed KV is kept

    # HTTP
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    graceful_timeout: float = 30.0
    health_generate_timeout: float = 20.0
    max_request_bytes: int = 64 * 1024 * 1024  # a larger body gets 413, read no further
    max_queued_requests: int | None = None  # None: no bound; else a request beyond N waiting gets 503
    request_read_timeout: float = 30.0  # a client slower than this sending headers or body is dropped
    api_workers: int = 1  # API processes sharing the HTTP port (SO_REUSEPORT)
    api_worker_index: int = 0  # which of them this process is (the supervisor sets it per child)

    # Observability
    enable_metrics: bool = True
    otlp_traces_endpoint: str | None = None
    otlp_traces_protocol: str = "http/protobuf"
    log_level: str = "info"

    # Sockets (the PULL side of each binds)
    scheduler_input: str = ""
    detokenizer_input: str = ""
    tokenizer_input: str = ""
    ready_endpoint: str | None = None

    def encode(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def decode(cls, text: str) -> ServerConfig:
        return msgspec.json.decode(text, type=cls)

    @property
    def engine_type(self) -> str:
        """The ``engine_type`` metrics label: unified, prefill or decode."""
        return "unified" if self.disaggregation_mode == "null" else self.disaggregation_mode

    def bootstrap_endpoint(self) -> str:
        """Prefill: the ZeroMQ endpoint its scheduler binds for decode servers' KV fetches."""
        if self.disaggregation_bootstrap_endpoint:
            return self.disaggregation_bootstrap_endpoint
        return f"tcp://{self.host}:{self.disaggregation_bootstrap_port}"

    @property
    def api_name(self) -> str:
        """The API process's name in logs and ready reports: ``api``, or ``api-I`` of several."""
        return "api" if self.api_workers == 1 else f"api-{self.api_worker_index}"

    def tokenizer_endpoint(self, worker: int) -> str:
        """Where API worker ``worker`` receives its frames: ``tokenizer_input`` itself when
        there is one worker; of several, ``tokenizer_input`` with ``-I`` appended (ipc), or
        its port plus I (tcp)."""
        if self.api_workers == 1:
            return self.tokenizer_input
        if self.tokenizer_input.startswith("tcp://"):
            address, port = self.tokenizer_input.rsplit(":", 1)
            return f"{address}:{int(port) + worker}"
        return f"{self.tokenizer_input}-{worker}"

    def kv_tokens_needed(self, prompt_len: int, max_new_tokens: int) -> int:
        """KV slots one request may hold at its peak. A dLLM request refines whole blocks,
        so its last block takes ``dllm_block_size`` slots even when the output stops short."""
        if self.mode == "dllm":
            block = self.dllm_block_size
            return prompt_len + -(-max_new_tokens // block) * block
        return prompt_len + max_new_tokens

    def validate(self) -> None:
        problems = []
        if self.max_total_tokens < 16:
            problems.append("--max-total-tokens must be at least 16")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            problems.append("--chunked-prefill-size must be positive, or -1 to disable chunking")
        if self.stream_interval < 1:
            problems.append("--stream-interval must be at least 1")
        if self.max_request_bytes <= 0 or self.request_read_timeout <= 0:
            problems.append("--max-request-bytes and --request-read-timeout must be positive")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            problems.append("--max-queued-requests must be 0 or more (leave it out for no bound)")
        if not 1 <= self.api_workers < MAX_API_WORKERS:
            problems.append(f"--api-workers must be between 1 and {MAX_API_WORKERS - 1}")
        elif not 0 <= self.api_worker_index < self.api_workers:
            problems.append("--api-worker-index must be below --api-workers")
        if self.max_running_requests < 1:
            problems.append("--max-running-requests must be at least 1")
        if self.dllm_block_size < 1:
            problems.append("--dllm-block-size must be at least 1")
        if not 1 <= self.dllm_steps <= self.dllm_block_size:
            problems.append("--dllm-steps must be between 1 and --dllm-block-size (each pass unmasks at least one position)")
        if self.hicache_host_tokens < 0:
            problems.append("--hicache-host-tokens must be 0 (off) or positive")
        if self.hicache_storage_dir is not None and self.hicache_host_tokens == 0:
            problems.append("--hicache-storage-dir needs the host tier: give --hicache-host-tokens N too")
        if self.disaggregation_mode != "null" and self.mode != "generate":
            problems.append("--disaggregation-mode needs --mode generate")
        if not 0 < self.disaggregation_bootstrap_port < 65536:
            problems.append("--disaggregation-bootstrap-port must be a TCP port (1-65535)")
        endpoint = self.disaggregation_bootstrap_endpoint
        if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://")):
            problems.append("--disaggregation-bootstrap-endpoint must be a tcp:// or ipc:// endpoint")
        if self.disaggregation_bootstrap_timeout <= 0:
            problems.append("--disaggregation-bootstrap-timeout must be positive")
        if self.otlp_traces_protocol not in ("http/protobuf", "grpc"):
            problems.append("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be http/protobuf or grpc")
        if problems:
            raise ValueError("; ".join(problems))


def storage_dir_problem(directory: str) -> str | None:
    """Why ``directory`` cannot hold HiCache storage files, or None when it can. Checked by
    the scheduler (the process that writes there) and, for ``serve``, by the CLI first."""
    if not directory:
        return "the directory is empty: give the absolute path of an existing directory"
    if not os.path.isabs(directory):
        return f"the directory must be an absolute path, got {directory!r}"
    if not os.path.exists(directory):
        return f"storage directory {directory!r} does not exist"
    if not os.path.isdir(directory):
        return f"storage path {directory!r} is not a directory"
    if not os.access(directory, os.R_OK | os.W_OK | os.X_OK):
        return f"storage directory {directory!r} is not readable and writable by the scheduler"
    return None


def add_server_args(parser: argparse.ArgumentParser, *, endpoints_required: bool) -> None:
    d = ServerConfig()
    g = parser.add_argument_group("model")
    g.add_argument("--model-path", default=d.model_path, help="local Hugging Face-style model directory")
    g.add_argument("--served-model-name", default=d.served_model_name)
    g.add_argument("--model-seed", type=int, default=d.model_seed, help="seed of the built-in model's weights")
    g.add_argument("--device", default=d.device, help="auto (CUDA when available, else CPU), cpu, cuda, cuda:N")
    g.add_argument("--torch-threads", type=int, default=d.torch_threads, help="CPU threads for the model (default: cores - 2, at least 1)")
    g.add_argument("--mode", choices=["generate", "embedding", "dllm"], default=d.mode)
    g.add_argument("--context-length", type=int, default=d.context_length)
    g.add_argument(
        "--skip-tokenizer-init",
        action="store_true",
        help="token ids in, token ids out (SGLang's flag): no process loads a tokenizer; prompts are token ids and "
        "answers carry output ids without text; text prompts, chat, stop strings and media get 400",
    )

    g = parser.add_argument_group("scheduler")
    g.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens, help="KV pool capacity in tokens")
    g.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    g.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size, help="-1 disables chunking")
    g.add_argument("--stream-interval", type=int, default=d.stream_interval)
    g.add_argument("--max-new-tokens-limit", type=int, default=d.max_new_tokens_limit)
    g.add_argument(
        "--dllm-block-size", type=int, default=d.dllm_block_size, help="--mode dllm: tokens per block (one output row each)"
    )
    g.add_argument("--dllm-steps", type=int, default=d.dllm_steps, help="--mode dllm: refinement passes per block")
    g.add_argument(
        "--discard-output",
        action="store_true",
        help="benchmarking only: the scheduler builds and encodes its token frames but drops them, so clients get no output",
    )
    g.add_argument(
        "--dense-usage-columns",
        action="store_true",
        help="every token frame row also carries prompt, cached, image, audio and video token counts as int32 columns, "
        "for a consumer that keeps no per-request state (docs/wire.md)",
    )

    g = parser.add_argument_group("hicache")
    g.add_argument(
        "--hicache-host-tokens",
        type=int,
        default=d.hicache_host_tokens,
        help="host-memory KV tier under the device pool, in tokens: evicted prefixes move there and come back on a hit (0: off)",
    )
    g.add_argument(
        "--hicache-storage-dir",
        default=d.hicache_storage_dir,
        help="existing directory for the storage tier under the host tier (file backend); also POST /hicache/storage/attach",
    )

    g = parser.add_argument_group("PD disaggregation")
    g.add_argument(
        "--disaggregation-mode",
        choices=["null", "prefill", "decode"],
        default=d.disaggregation_mode,
        help="prefill: compute KV and the first token, and send the KV to a decode server; decode: take requests "
        "prebuilt from a prefill server (run both behind sglang-router); null: one unified server",
    )
    g.add_argument(
        "--disaggregation-bootstrap-port",
        type=int,
        default=d.disaggregation_bootstrap_port,
        help="prefill: TCP port on --host where decode servers fetch KV",
    )
    g.add_argument(
        "--disaggregation-bootstrap-endpoint",
        default=d.disaggregation_bootstrap_endpoint,
        help="prefill: a tcp:// or ipc:// ZeroMQ endpoint for KV fetches, instead of --host and the port",
    )
    g.add_argument(
        "--disaggregation-bootstrap-timeout",
        type=float,
        default=d.disaggregation_bootstrap_timeout,
        help="decode: seconds to wait for a request's KV before failing it; prefill: seconds unclaimed KV is kept",
    )

    g = parser.add_argument_group("http")
    g.add_argument("--host", default=d.host)
    g.add_argument("--port", type=int, default=d.port)
    g.add_argument("--api-key", default=d.api_key)
    g.add_argument("--graceful-timeout", type=float, default=d.graceful_timeout)
    g.add_argument("--health-generate-timeout", type=float, default=d.health_generate_timeout)
    g.add_argument(
        "--max-request-bytes", type=int, default=d.max_request_bytes, help="a larger request body gets 413 and is read no further"
    )
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=d.max_queued_requests,
        help="when this many requests wait for admission, a new one gets 503 with Retry-After (default: no bound)",
    )
    g.add_argument(
        "--request-read-timeout",
        type=float,
        default=d.request_read_timeout,
        help="seconds a client may take to send its request headers, and between parts of its body",
    )

    g.add_argument(
        "--api-workers",
        type=int,
        default=d.api_workers,
        help="API processes sharing the HTTP port (SO_REUSEPORT: the kernel spreads connections over them)",
    )
    g.add_argument(
        "--api-worker-index",
        type=int,
        default=d.api_worker_index,
        help="`tokenpipe api` run alone: which of the --api-workers this process is (serve sets it)",
    )

    g = parser.add_argument_group("observability")
    g.add_argument("--disable-metrics", action="store_true")
    g.add_argument("--otlp-traces-endpoint", default=None)
    g.add_argument("--log-level", default=d.log_level)

    g = parser.add_argument_group("sockets")
    g.add_argument("--scheduler-input", required=endpoints_required, default=None, help="ipc:// or tcp:// endpoint")
    g.add_argument("--detokenizer-input", required=endpoints_required, default=None)
    g.add_argument("--tokenizer-input", required=endpoints_required, default=None)
    g.add_argument("--ready-endpoint", default=None, help=argparse.SUPPRESS)
    g.add_argument("--config-json", default=None, help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace, environ: os._Environ[str] | dict[str, str] = os.environ) -> ServerConfig:
    given = args.config_json or environ.get(CONFIG_ENV)
    if given:
        config = ServerConfig.decode(given)
        config.validate()
        return config
    config = ServerConfig(
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        model_seed=args.model_seed,
        device=args.device,
        torch_threads=args.torch_threads,
        mode=args.mode,
        context_length=args.context_length,
        skip_tokenizer_init=args.skip_tokenizer_init,
        max_total_tokens=args.max_total_tokens,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        stream_interval=args.stream_interval,
        max_new_tokens_limit=args.max_new_tokens_limit,
        discard_output=args.discard_output,
        dense_usage_columns=args.dense_usage_columns,
        dllm_block_size=args.dllm_block_size,
        dllm_steps=args.dllm_steps,
        hicache_host_tokens=args.hicache_host_tokens,
        hicache_storage_dir=os.path.abspath(args.hicache_storage_dir) if args.hicache_storage_dir else None,
        disaggregation_mode=args.disaggregation_mode,
        disaggregation_bootstrap_port=args.disaggregation_bootstrap_port,
        disaggregation_bootstrap_endpoint=args.disaggregation_bootstrap_endpoint,
        disaggregation_bootstrap_timeout=args.disaggregation_bootstrap_timeout,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        graceful_timeout=args.graceful_timeout,
        health_generate_timeout=args.health_generate_timeout,
        max_request_bytes=args.max_request_bytes,
        max_queued_requests=args.max_queued_requests,
        request_read_timeout=args.request_read_timeout,
        api_workers=args.api_workers,
        api_worker_index=args.api_worker_index,
        enable_metrics=not args.disable_metrics,
        otlp_traces_endpoint=args.otlp_traces_endpoint or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
        otlp_traces_protocol=environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
        log_level=args.log_level,
        scheduler_input=args.scheduler_input or "",
        detokenizer_input=args.detokenizer_input or "",
        tokenizer_input=args.tokenizer_input or "",
        ready_endpoint=args.ready_endpoint,
    )
    config.validate()
    return config
