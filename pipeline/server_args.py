"""Reading a ``ServerConfig`` from the command line (or whole, as JSON) and checking it: the
flags are generated from the config's declarations (``pipeline.flags``), and
``check_config`` refuses a combination no process could run with, naming each flag at fault.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from pipeline.config import CONFIG_ENV, ServerConfig
from pipeline.flags import add_flags, from_args
from pipeline.kv_events import parse_kv_events_config
from pipeline.lora_modules import parse_lora_modules
from pipeline.worker_ids import MAX_API_WORKERS


def check_config(config: ServerConfig) -> None:
    """Raises ValueError naming every flag whose value no process could run with."""
    problems = []
    if config.max_total_tokens < 16:
        problems.append("--max-total-tokens must be at least 16")
    if config.chunked_prefill_size == 0 or config.chunked_prefill_size < -1:
        problems.append("--chunked-prefill-size must be positive, or -1 to disable chunking")
    if config.stream_interval < 1:
        problems.append("--stream-interval must be at least 1")
    if config.graceful_timeout < 0:
        problems.append("--graceful-timeout must be 0 (no drain) or more seconds")
    if config.max_request_bytes <= 0 or config.request_read_timeout <= 0:
        problems.append("--max-request-bytes and --request-read-timeout must be positive")
    if config.max_queued_requests is not None and config.max_queued_requests < 0:
        problems.append("--max-queued-requests must be 0 or more (leave it out for no bound)")
    if not 1 <= config.api_workers < MAX_API_WORKERS:
        problems.append(f"--api-workers must be between 1 and {MAX_API_WORKERS - 1}")
    elif not 0 <= config.api_worker_index < config.api_workers:
        problems.append("--api-worker-index must be below --api-workers")
    if config.responses_store_max_count < 0 or config.responses_store_bytes < 0:
        problems.append(
            "--responses-store-max-count and --responses-store-bytes must be 0 (store "
            "nothing) or more"
        )
    if config.max_running_requests < 1:
        problems.append("--max-running-requests must be at least 1")
    if config.constrained_json_max_whitespace < 0 or config.grammar_compile_timeout <= 0:
        problems.append(
            "--constrained-json-max-whitespace must be 0 or more, --grammar-compile-timeout "
            "positive"
        )
    if config.dllm_block_size < 1:
        problems.append("--dllm-block-size must be at least 1")
    if not 1 <= config.dllm_steps <= config.dllm_block_size:
        problems.append(
            "--dllm-steps must be between 1 and --dllm-block-size (each pass unmasks at least "
            "one position)"
        )
    if config.hicache_host_tokens < 0:
        problems.append("--hicache-host-tokens must be 0 (off) or positive")
    if config.hicache_storage_dir is not None and config.hicache_host_tokens == 0:
        problems.append(
            "--hicache-storage-dir needs the host tier: give --hicache-host-tokens N too"
        )
    if config.disaggregation_mode != "null" and config.mode != "generate":
        problems.append("--disaggregation-mode needs --mode generate")
    if not 0 < config.disaggregation_bootstrap_port < 65536:
        problems.append("--disaggregation-bootstrap-port must be a TCP port (1-65535)")
    endpoint = config.disaggregation_bootstrap_endpoint
    if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://")):
        problems.append("--disaggregation-bootstrap-endpoint must be a tcp:// or ipc:// endpoint")
    if config.disaggregation_bootstrap_timeout <= 0:
        problems.append("--disaggregation-bootstrap-timeout must be positive")
    if config.otlp_traces_protocol not in ("http/protobuf", "grpc"):
        problems.append("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be http/protobuf or grpc")
    problems.extend(_routing_problems(config))
    problems.extend(_lora_problems(config))
    problems.extend(_speculative_problems(config))
    if problems:
        raise ValueError("; ".join(problems))


def _routing_problems(config: ServerConfig) -> list[str]:
    problems = []
    if (
        config.scheduling_policy == "priority"
        and config.enable_priority_scheduling
        and not config.schedule_low_priority_values_first
    ):
        problems.append(
            "--scheduling-policy priority runs lower priority values first and "
            "--enable-priority-scheduling higher ones: give one (or add "
            "--schedule-low-priority-values-first)"
        )
    if config.kv_events_block_size < 1:
        problems.append("--kv-events-block-size must be at least 1")
    if config.kv_events_config is not None:
        try:
            parse_kv_events_config(config.kv_events_config)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


def _lora_problems(config: ServerConfig) -> list[str]:
    if not config.lora_enabled:
        return []
    problems = []
    if config.max_loras < 1 or config.max_lora_rank < 1:
        problems.append("--max-loras and --max-lora-rank must be at least 1")
    if config.max_cpu_loras is not None and config.max_cpu_loras < config.max_loras:
        problems.append("--max-cpu-loras must be at least --max-loras")
    if config.mode != "generate":
        problems.append("LoRA adapters (--enable-lora) need --mode generate")
    try:
        parse_lora_modules(config.lora_modules, config.lora_paths)
    except ValueError as exc:
        problems.append(str(exc))
    return problems


def _speculative_problems(config: ServerConfig) -> list[str]:
    try:
        spec = config.speculative
    except ValueError as exc:
        return [str(exc)]
    if spec is not None and config.mode != "generate":
        return [
            "speculative decoding (--speculative-config, --speculative-algorithm) needs --mode "
            "generate"
        ]
    return []


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Every ``ServerConfig`` flag, and ``--config-json`` (hidden): a whole config at once."""
    add_flags(parser, ServerConfig)
    parser.add_argument("--config-json", default=None, help=argparse.SUPPRESS)


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> ServerConfig:
    """The validated config: given whole (``--config-json``, or ``TOKENPIPE_CONFIG_JSON`` from
    the supervisor), or built from the flags and the OpenTelemetry variables."""
    given = args.config_json or environ.get(CONFIG_ENV)
    config = ServerConfig.decode(given) if given else from_args(ServerConfig, args, environ)
    check_config(config)
    return config
