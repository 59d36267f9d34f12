"""The one typed configuration object every process receives.

Command-line flags and the ``OTEL_*`` variables are read here, once, into a
``ServerConfig``; nothing deeper in the code reads ``os.environ`` or ``argv``. The
supervisor hands each child the same object as JSON (in ``TOKENPIPE_CONFIG_JSON``), so the three
processes can never disagree about a setting.
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

import msgspec

from pipeline.flags import Flag, NoFlag
from pipeline.model_settings import ModelSettings
from pipeline.speculative_config import SpeculativeConfig, parse_speculative

DisaggregationMode = Literal["null", "prefill", "decode"]
# The names tokenizer_proc/parsers registers (tests/unit/test_chat_parsers_flags.py keeps them
# equal).
ToolCallParserName = Literal["hermes", "llama3_json", "mistral"]
ReasoningParserName = Literal["deepseek_r1", "qwen3"]
# The metric names /metrics serves: tokenpipe's own, or a peer's (tokenizer_proc/metrics_compat.py).
MetricsCompat = Literal["tokenpipe", "sglang", "vllm"]
Switch = Literal["auto", "on", "off"]
SchedulingPolicy = Literal["fcfs", "priority"]

# The supervisor hands its children the whole config as JSON in this variable.
CONFIG_ENV = "TOKENPIPE_CONFIG_JSON"


def _absolute_or_none(text: str) -> str | None:
    """``--hicache-storage-dir``: relative to where the command runs; empty means none."""
    return os.path.abspath(text) if text else None


class ServerConfig(ModelSettings, kw_only=True, forbid_unknown_fields=True):
    """Each field is declared once, with its command-line flag beside it (``pipeline.flags``):
    ``pipeline.server_args`` generates the flags from these declarations and checks the
    values. The model's settings come first, from ``ModelSettings`` (pipeline/model_settings.py).
    """

    # Scheduler
    max_total_tokens: Annotated[int, Flag("scheduler", "KV pool capacity in tokens")] = 32768
    max_running_requests: Annotated[
        int, Flag("scheduler", "requests decoded together in one batch, at most")
    ] = 256
    disable_overlap_schedule: Annotated[
        bool, Flag("scheduler", "run decode forwards inline, not on a thread beside host work")
    ] = False
    decode_kv_rows: Annotated[
        Switch,
        Flag(
            "scheduler",
            "decode passes read a dense copy of the running requests' KV, a row each, of at most "
            "--max-total-tokens positions, instead of gathering it from the pool: auto (on for "
            "the CPU, off on CUDA), on, off",
        ),
    ] = "auto"
    chunked_prefill_size: Annotated[
        int, Flag("scheduler", "prompt tokens prefilled per step, at most; -1 disables chunking")
    ] = 2048
    enable_deterministic_inference: Annotated[
        bool,
        Flag(
            "scheduler",
            "the same tokens and logprobs for a seeded request whether its prompt is prefilled "
            "whole, chunked or served from the prefix cache, alone or in any batch: kernels whose "
            "result for a row does not depend on the other rows (SGLang's flag)",
        ),
    ] = False
    stream_interval: Annotated[
        int,
        Flag("scheduler", "a streaming request emits every N tokens (and on its first and last)"),
    ] = 1
    max_new_tokens_limit: Annotated[
        int, Flag("scheduler", "the largest max_new_tokens a request may ask for")
    ] = 4096
    dllm_block_size: Annotated[
        int, Flag("scheduler", "--mode dllm: tokens per block (one output row each)")
    ] = 4
    dllm_steps: Annotated[int, Flag("scheduler", "--mode dllm: refinement passes per block")] = 4
    discard_output: Annotated[
        bool,
        Flag(
            "scheduler",
            "benchmarking only: the scheduler builds and encodes its token frames but drops them, "
            "so clients get no output",
        ),
    ] = False
    dense_usage_columns: Annotated[
        bool,
        Flag(
            "scheduler",
            "every token frame row also carries prompt, cached, image, audio and video token "
            "counts as int32 columns, for a consumer that keeps no per-request state "
            "(docs/wire.md)",
        ),
    ] = False

    # LoRA adapters (docs/design/lora.md)
    enable_lora: Annotated[
        bool, Flag("lora", "serve LoRA adapters (PEFT's format) per request")
    ] = False
    lora_modules: Annotated[
        tuple[str, ...],
        Flag("lora", "adapters served from the start: name=path, or vLLM's JSON", nargs="+"),
    ] = ()
    lora_paths: Annotated[
        tuple[str, ...], Flag("lora", "SGLang's spelling: name=path, path, or JSON", nargs="+")
    ] = ()
    max_loras: Annotated[int, Flag("lora", "adapters a batch may use at once (slots)")] = 1
    max_lora_rank: Annotated[int, Flag("lora", "the largest adapter rank served")] = 16
    max_cpu_loras: Annotated[
        int | None, Flag("lora", "adapters kept read in memory (default: --max-loras)")
    ] = None

    # Speculative decoding (docs/operations.md): vLLM's JSON or SGLang's flags
    speculative_config: Annotated[
        str | None,
        Flag(
            "speculative",
            'vLLM\'s JSON: {"method": "ngram"|"draft_model", "num_speculative_tokens": k, '
            '"prompt_lookup_min", "prompt_lookup_max" (default 5 and 5), "model" (the draft '
            'checkpoint), "disable_by_batch_size"}',
        ),
    ] = None
    speculative_algorithm: Annotated[
        str | None, Flag("speculative", "SGLang's spelling: NGRAM or STANDALONE (a draft model)")
    ] = None
    speculative_num_draft_tokens: Annotated[
        int | None,
        Flag(
            "speculative",
            "drafts per request per step plus the verified token, as SGLang counts them "
            "(default 5: 4 drafts)",
        ),
    ] = None
    speculative_num_steps: Annotated[
        int | None,
        Flag(
            "speculative",
            "STANDALONE: draft model steps, one draft each (SGLang's; with it "
            "--speculative-num-draft-tokens is this plus one; NGRAM ignores it, as SGLang's)",
        ),
    ] = None
    speculative_eagle_topk: Annotated[
        int | None, Flag("speculative", "SGLang's draft tree width: 1 only (one chain per request)")
    ] = None
    speculative_draft_model_path: Annotated[
        str | None, Flag("speculative", "STANDALONE: the draft checkpoint (the same tokenizer)")
    ] = None
    speculative_ngram_min_match_window_size: Annotated[
        int | None, Flag("speculative", "NGRAM: the shortest suffix matched (default 1)")
    ] = None
    speculative_ngram_max_match_window_size: Annotated[
        int | None, Flag("speculative", "NGRAM: the longest suffix matched (default 12)")
    ] = None
    speculative_disable_by_batch_size: Annotated[
        int | None,
        Flag(
            "speculative",
            "a step with more running requests than this drafts nothing (default 32; 0: no "
            "limit; vLLM V0's flag)",
        ),
    ] = None

    # Tenancy and routing signals (docs/design/tenancy.md)
    scheduling_policy: Annotated[
        SchedulingPolicy,
        Flag(
            "scheduler",
            "fcfs, or priority: waiting requests start by their priority (lower first, as "
            "vLLM's), and one that cannot start preempts the lowest running request",
        ),
    ] = "fcfs"
    enable_priority_scheduling: Annotated[
        bool,
        Flag("scheduler", "SGLang's spelling of priority scheduling (higher values first)"),
    ] = False
    schedule_low_priority_values_first: Annotated[
        bool,
        Flag("scheduler", "with --enable-priority-scheduling: lower values first (SGLang's flag)"),
    ] = False
    kv_events_config: Annotated[
        str | None,
        Flag(
            "scheduler",
            "publish KV cache events for KV-aware routers, vLLM's JSON: "
            '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": ..., '
            '"replay_endpoint": ..., "topic": ..., "buffer_steps": ..., "hwm": ...}',
        ),
    ] = None
    kv_events_block_size: Annotated[
        int, Flag("scheduler", "tokens per block in KV cache events and their hashes")
    ] = 16
    python_hash_seed: Annotated[
        str | None,
        NoFlag(
            "seeds KV cache events' block hashes as vLLM's (default: vLLM's fixed seed)",
            env="PYTHONHASHSEED",
        ),
    ] = None
    enable_request_id_headers: Annotated[
        bool,
        Flag("http", "answer with X-Request-Id, the request's id (vLLM's flag)"),
    ] = False
    # HiCache: a host tier under the device KV pool, and a storage tier under that
    hicache_host_tokens: Annotated[
        int,
        Flag(
            "hicache",
            "host-memory KV tier under the device pool, in tokens: evicted prefixes move there "
            "and come back on a hit (0: off)",
        ),
    ] = 0
    # Made absolute when read; storage can also be attached at runtime.
    hicache_storage_dir: Annotated[
        str | None,
        Flag(
            "hicache",
            "existing directory for the storage tier under the host tier (file backend); also "
            "POST /hicache/storage/attach",
            parse=_absolute_or_none,
        ),
    ] = None

    # PD disaggregation: a prefill server sends each request's KV to a decode server
    disaggregation_mode: Annotated[
        DisaggregationMode,
        Flag(
            "PD disaggregation",
            "prefill: compute KV and the first token, and send the KV to a decode server; decode: "
            "take requests prebuilt from a prefill server (run both behind sglang-router); null: "
            "one unified server",
        ),
    ] = "null"
    disaggregation_bootstrap_port: Annotated[
        int, Flag("PD disaggregation", "prefill: TCP port on --host where decode servers fetch KV")
    ] = 8998
    disaggregation_bootstrap_endpoint: Annotated[
        str | None,
        Flag(
            "PD disaggregation",
            "prefill: a tcp:// or ipc:// ZeroMQ endpoint for KV fetches, instead of --host and "
            "the port",
        ),
    ] = None
    disaggregation_bootstrap_timeout: Annotated[
        float,
        Flag(
            "PD disaggregation",
            "decode: seconds to wait for a request's KV before failing it; prefill: seconds "
            "unclaimed KV is kept",
        ),
    ] = 30.0

    # HTTP
    host: Annotated[str, Flag("http", "address the HTTP server listens on")] = "127.0.0.1"
    port: Annotated[int, Flag("http", "HTTP port")] = 30000
    api_key: Annotated[
        str | None,
        Flag(
            "http",
            "every endpoint but /, /health and /metrics needs the key, as "
            "Authorization: Bearer KEY or x-api-key: KEY",
        ),
    ] = None
    graceful_timeout: Annotated[
        float, Flag("http", "on SIGTERM, seconds in-flight requests get to finish")
    ] = 30.0
    health_generate_timeout: Annotated[
        float, Flag("http", "seconds /health_generate waits for its one-token request")
    ] = 20.0
    max_request_bytes: Annotated[
        int, Flag("http", "a larger request body gets 413 and is read no further")
    ] = 64 * 1024 * 1024
    max_queued_requests: Annotated[
        int | None,
        Flag(
            "http",
            "when this many requests wait for admission, a new one gets 503 with Retry-After "
            "(default: no bound)",
        ),
    ] = None
    request_read_timeout: Annotated[
        float,
        Flag(
            "http",
            "seconds a client may take to send its request headers, and between parts of its body",
        ),
    ] = 30.0
    api_workers: Annotated[
        int,
        Flag(
            "http",
            "API processes sharing the HTTP port (SO_REUSEPORT: the kernel spreads connections "
            "over them)",
        ),
    ] = 1
    # Which of them this process is: the supervisor sets it per child.
    api_worker_index: Annotated[
        int,
        Flag(
            "http",
            "`tokenpipe api` run alone: which of the --api-workers this process is (serve sets it)",
        ),
    ] = 0
    # SGLang's flag and default: without it each /generate stream event repeats the whole
    # output so far (what SGLang's own clients slice with output[prev:]), which costs bytes
    # quadratic in the output's length; with it an event carries only what is new.
    incremental_streaming_output: Annotated[
        bool,
        Flag(
            "http",
            "/generate stream events carry only the text, output_ids and output logprobs new "
            "since the previous event (SGLang's flag); without it each event carries everything "
            "so far, as SGLang streams by default",
        ),
    ] = False
    enable_tokenizer_info_endpoint: Annotated[
        bool,
        Flag(
            "http",
            "serve GET /tokenizer_info: the tokenizer's configuration (vLLM's flag; off: 404)",
        ),
    ] = False
    reject_unknown_fields: Annotated[
        bool, Flag("http", "refuse (400) request fields no schema knows, and custom chat roles")
    ] = False

    # Chat: how an answer splits into content, tool calls and reasoning (vLLM's and SGLang's flags)
    tool_call_parser: Annotated[
        ToolCallParserName,
        Flag(
            "chat",
            "the format tool calls are read in when a chat request gives tools with tool_choice "
            "auto: hermes (Qwen 2.5 and 3, Hermes, the built-in template), llama3_json (Llama 3.1 "
            "and later), mistral ([TOOL_CALLS])",
        ),
    ] = "hermes"
    reasoning_parser: Annotated[
        ReasoningParserName | None,
        Flag(
            "chat",
            "split <think>...</think> out of chat answers into reasoning_content: deepseek_r1 "
            "(the answer starts inside reasoning), qwen3 (default: none, all text is content)",
        ),
    ] = None

    # Structured outputs: JSON whitespace and compile limits (docs/api.md, "Structured outputs")
    constrained_json_max_whitespace: Annotated[
        int,
        Flag(
            "structured outputs",
            "JSON answers put at most N whitespace characters between two tokens: room for a "
            "newline and an indentation, not a budget spent on blanks (0: no bound)",
        ),
    ] = 24
    constrained_json_disable_any_whitespace: Annotated[
        bool, Flag("structured outputs", "JSON answers are compact (SGLang's flag)")
    ] = False
    grammar_compile_timeout: Annotated[
        float, Flag("structured outputs", "seconds a grammar may compile; longer is a 400")
    ] = 5.0

    # The Responses API's stored responses (previous_response_id, GET /v1/responses/{id})
    responses_store_max_count: Annotated[
        int,
        Flag(
            "chat",
            "stored responses kept for previous_response_id and GET /v1/responses/{id}; the "
            "oldest go first",
        ),
    ] = 10_000
    responses_store_bytes: Annotated[
        int,
        Flag(
            "chat",
            "bytes of stored responses (their JSON, conversations included) kept at most; the "
            "oldest go first",
        ),
    ] = 256 * 1024 * 1024

    # Observability
    enable_metrics: Annotated[
        bool,
        Flag(
            "observability",
            "no Prometheus metrics (/metrics is empty) and no timing collection",
            spelling="--disable-metrics",
        ),
    ] = True
    metrics_compat: Annotated[
        MetricsCompat,
        Flag(
            "observability",
            "the metric names, labels and buckets /metrics serves: tokenpipe's own, or SGLang's "
            "or vLLM's for their dashboards and alerts (series they lack keep their tokenpipe: "
            "names)",
        ),
    ] = "tokenpipe"
    otlp_traces_endpoint: Annotated[
        str | None,
        Flag(
            "observability",
            "export one span per request over OTLP to this URL (default: "
            "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)",
            env="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        ),
    ] = None
    otlp_traces_protocol: Annotated[
        str,
        NoFlag(
            "OpenTelemetry's own variable sets it; there is no flag",
            env="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        ),
    ] = "http/protobuf"
    log_level: Annotated[str, Flag("observability", "debug, info, warning or error")] = "info"

    # Sockets (the PULL side of each binds); `tokenpipe serve` picks ipc:// ones when not given
    scheduler_input: Annotated[
        str, Flag("sockets", "ipc:// or tcp:// endpoint the scheduler reads")
    ] = ""
    detokenizer_input: Annotated[
        str, Flag("sockets", "ipc:// or tcp:// endpoint the detokenizer reads")
    ] = ""
    tokenizer_input: Annotated[str, Flag("sockets", "ipc:// or tcp:// endpoint the API reads")] = ""
    # Where a child reports ready: the supervisor's, set per child.
    ready_endpoint: Annotated[str | None, Flag("sockets", hidden=True)] = None

    def encode(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def decode(cls, text: str) -> ServerConfig:
        return msgspec.json.decode(text, type=cls)

    @property
    def priority_scheduling(self) -> bool:
        """Whether requests are admitted by priority (either peer's flag)."""
        return self.scheduling_policy == "priority" or self.enable_priority_scheduling

    @property
    def lora_enabled(self) -> bool:
        """Whether adapters are served (``--enable-lora``, or adapters named at start)."""
        return self.enable_lora or bool(self.lora_modules or self.lora_paths)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """Speculative decoding's settings from either peer's flags (None: off)."""
        return parse_speculative(self)

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
