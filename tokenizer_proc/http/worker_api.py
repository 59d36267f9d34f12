"""The endpoints a router calls on each worker (SGLang's names and shapes, so sglang-router
drives tokenpipe as it drives SGLang): ``GET /server_info`` (and ``/get_server_info``),
``GET /model_info`` (and ``/get_model_info``), ``GET /get_load`` and ``GET``/``POST
/flush_cache``. Each route's function says what it answers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pipeline.io_struct import SchedulerStatsReport
from pipeline.tokenizer_loader import model_directory
from tokenizer_proc.request_edge.body import decode_body
from tokenizer_proc.http.common import error_response
from tokenizer_proc.http.peer_api import package_version
from tokenizer_proc.tokenizer_manager import TokenizerManager

# What tokenpipe's scheduler runs, whatever the checkpoint (scheduler_proc/model/llama.py): the
# answer for a model directory without a config.json, and for the built-in model.
_ARCHITECTURE: tuple[str, tuple[str, ...]] = ("llama", ("LlamaForCausalLM",))


class FlushCacheBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


@dataclass(frozen=True)
class ModelIdentity:
    """Facts about the served model that never change while the server runs."""

    path: str  # the model directory (tokenizer files, and config and weights when given)
    model_type: str | None
    architectures: tuple[str, ...] | None
    # generation_config.json's sampling values (vLLM reads the same keys as its defaults);
    # None when it sets none. Reported, not applied: a request's own params decide.
    preferred_sampling_params: dict[str, float | int] | None = None

    @classmethod
    def of(cls, model_path: str | None) -> ModelIdentity:
        directory = model_directory(model_path)
        if model_path is None:
            return cls(str(directory), *_ARCHITECTURE)
        return cls(str(directory), *_hf_architecture(directory), _generation_defaults(directory))


def build_worker_router(tm: TokenizerManager) -> APIRouter:
    router = APIRouter()
    model = ModelIdentity.of(tm.config.model_path)

    @router.get("/server_info")
    @router.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return server_info_of(tm, model)

    # What the model is.
    @router.get("/model_info")
    @router.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return model_info_of(tm, model)

    # One entry per data-parallel rank (tokenpipe has one); sglang-router sums ``num_tokens``
    # over the entries into the worker's load.
    @router.get("/get_load")
    async def get_load() -> list[dict[str, int]]:
        return [load_of(tm)]

    # Drops the prefix cache on every tier, through a ``FlushCacheControl`` round trip to the
    # scheduler. As in SGLang it is refused (400) while any request is running or waiting,
    # and nothing changes then.
    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request) -> Response:
        body = await request.body()
        if body.strip():  # sglang-router sends none; {} means the same
            decode_body(body, FlushCacheBody)
        result = await tm.controls.flush_cache()
        if result is None:
            return error_response(
                503, "the scheduler did not answer in time", err_type="service_unavailable"
            )
        if not result.ok:
            return error_response(400, result.error)
        dropped = {
            "device": result.device_tokens,
            "host": result.host_tokens,
            "storage": result.storage_tokens,
        }
        return JSONResponse({"message": "Cache flushed.", "flushed_tokens": dropped})

    return router


def server_info_of(tm: TokenizerManager, model: ModelIdentity) -> dict[str, Any]:
    """The configuration, the served model and the scheduler's latest report, with SGLang's
    ``max_total_num_tokens`` (the KV pool's size) and ``version``. sglang-router reads
    ``model_path``, ``served_model_name``, ``dp_size``, ``tp_size``, ``disaggregation_mode``,
    ``model_type`` and ``architectures`` from it when it registers a worker:
    ``served_model_name`` becomes the worker's model id, and ``model_path`` is where it loads
    its tokenizer from, so ``model_path`` is always a local directory holding
    ``tokenizer.json`` (for the built-in model, the shipped tokenizer's; its weights come
    from ``--model-seed``)."""
    config = tm.config
    info = msgspec.to_builtins(config)
    info.pop("api_key", None)
    info.update(
        model_path=model.path,
        tokenizer_path=model.path,
        served_model_name=tm.model_name,
        is_generation=config.mode != "embedding",
        model_type=model.model_type,
        architectures=model.architectures,
        tp_size=1,
        dp_size=1,
        model_name=tm.model_name,
        context_length=tm.context_length,
        vocab_size=tm.vocab_size,
        live_requests=len(tm.states),
        aborted_requests=tm.num_aborted_requests,
        scheduler=report_fields(tm.last_scheduler_report) if tm.last_scheduler_report else None,
        engine_type=config.engine_type,
        # SGLang's names: the KV pool's size in tokens (the scheduler's own, once it has
        # reported) and the package's version.
        max_total_num_tokens=tm.last_scheduler_report.kv_capacity
        if tm.last_scheduler_report
        else config.max_total_tokens,
        version=package_version(),
        disaggregation_bootstrap_endpoint=config.bootstrap_endpoint()
        if config.disaggregation_mode == "prefill"
        else None,
    )
    return info


def report_fields(report: SchedulerStatsReport) -> dict[str, Any]:
    """The scheduler's report as JSON takes it: its adapters (structs) as objects too."""
    fields = msgspec.structs.asdict(report)
    fields["lora_adapters"] = [msgspec.structs.asdict(a) for a in report.lora_adapters]
    return fields


def model_info_of(tm: TokenizerManager, model: ModelIdentity) -> dict[str, Any]:
    # Under --skip-tokenizer-init there is no tokenizer, and media needs its placeholders.
    media = tm.tokenizer.media_token_ids if tm.tokenizer is not None else {}
    return {
        "model_path": model.path,
        "tokenizer_path": model.path,
        "is_generation": tm.config.mode != "embedding",
        "preferred_sampling_params": model.preferred_sampling_params,
        "weight_version": tm.weight_version,
        "has_image_understanding": "image" in media,
        "has_audio_understanding": "audio" in media,
        "model_type": model.model_type,
        "architectures": model.architectures,
        "served_model_name": tm.model_name,
        "max_context_length": tm.context_length,
        "vocab_size": tm.vocab_size,
    }


def load_of(tm: TokenizerManager) -> dict[str, int]:
    """SGLang's ``GetLoadReqOutput`` for the one rank, from what the API process knows now:
    its live requests, and the scheduler's latest report (at most about half a second old
    while it works; it reports once more when it goes idle).

    - ``num_reqs``: the live requests (waiting, running, or on their way to the scheduler);
      with several API workers, each knows only its own, so the scheduler's count of the
      requests it holds (every worker's) is taken when it is larger;
    - ``num_waiting_reqs``: those the scheduler was not running at its report;
    - ``num_tokens``: as SGLang counts it, the KV tokens requests hold (at the report; not
      the evictable cache) plus the prompt tokens of the requests not prefilled yet.
    """
    report = tm.last_scheduler_report
    num_reqs = len(tm.states)
    if tm.config.api_workers > 1 and report is not None:
        num_reqs = max(num_reqs, report.live_reqs)
    running = min(report.num_running_reqs, num_reqs) if report is not None else 0
    held = round(report.token_usage * report.kv_capacity) if report is not None else 0
    # A request's stats come with its first row, after its prefill: until then its prompt waits.
    waiting_tokens = sum(s.prompt_tokens for s in tm.states.values() if s.request_stats is None)
    return {
        "dp_rank": 0,
        "num_reqs": num_reqs,
        "num_waiting_reqs": num_reqs - running,
        "num_tokens": held + waiting_tokens,
    }


# generation_config.json keys that are sampling parameters of the same name and meaning.
_GENERATION_DEFAULTS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_new_tokens",
)


def _generation_defaults(directory: Path) -> dict[str, float | int] | None:
    try:
        config = json.loads((directory / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none, or unreadable: the tokenizer loader reports a broken one
        return None
    if not isinstance(config, dict):
        return None
    found = {
        key: config[key]
        for key in _GENERATION_DEFAULTS
        if isinstance(config.get(key), (int, float)) and not isinstance(config.get(key), bool)
    }
    return found or None


def _hf_architecture(directory: Path) -> tuple[str | None, tuple[str, ...] | None]:
    """``model_type`` and ``architectures`` of the checkpoint's config.json, as SGLang
    reports them; tokenpipe's own when the directory has none."""
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return _ARCHITECTURE
    except (
        OSError,
        ValueError,
    ):  # the scheduler loaded the model, so this is unlikely: say nothing
        return None, None
    if not isinstance(config, dict):
        return None, None
    model_type = config.get("model_type")
    architectures = config.get("architectures")
    return (
        model_type if isinstance(model_type, str) else None,
        tuple(architectures)
        if isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)
        else None,
    )
