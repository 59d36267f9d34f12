"""The scheduler decode-step benchmark's workload: a scheduler sized so that nothing retracts,
B requests with distinct first tokens (the prefix cache cannot share them), streamed with
``stream_interval`` 1 and long enough that none finishes during the run, and the checked
decode step that the timed loop repeats. With ``LoraSetup`` the scheduler serves adapters
(``--enable-lora``) and ``submit`` binds requests to them, as the API worker does."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from pipeline.config import ServerConfig
from pipeline.io_struct import (
    REQ_ID_DTYPE,
    Constraint,
    LoraRef,
    SamplingParams,
    TokenizedGenerateReqInput,
)
from pipeline.columns import from_column
from scheduler_proc.main import build_scheduler
from scheduler_proc.scheduler import Scheduler

SAMPLING_MODES = ("greedy", "sampled")
SAMPLED_TEMPERATURE = 0.7
SAMPLED_TOP_P = 0.9
FIRST_TOKEN = 16  # prompt ids start above the tokenizer's special tokens


def prompts(batch_size: int, context: int, vocab_size: int, seed: int) -> list[list[int]]:
    span = vocab_size - FIRST_TOKEN
    if batch_size > span:
        raise ValueError(f"at most {span} requests get distinct first tokens with this vocabulary")
    rng = random.Random(seed)
    return [
        [FIRST_TOKEN + i] + [rng.randrange(FIRST_TOKEN, vocab_size) for _ in range(context - 1)]
        for i in range(batch_size)
    ]


@dataclass(frozen=True)
class LoraSetup:
    """The LoRA flags of a benchmark scheduler: ``--lora-modules`` (``name=path`` entries),
    ``--max-loras`` and ``--max-lora-rank``."""

    modules: tuple[str, ...]
    max_loras: int
    max_lora_rank: int


def build(
    batch_size: int,
    tokens_per_req: int,
    torch_threads: int | None,
    device: str,
    model_path: str | None = None,
    deterministic: bool = False,
    lora: LoraSetup | None = None,
) -> Scheduler:
    """``lora`` None: a scheduler without ``--enable-lora``."""
    # Headroom beyond the requests' own KV: the pool also leaves slots for the next decode
    # step during admission, and nothing here may ever trigger a retraction.
    pool = batch_size * tokens_per_req + 2 * batch_size + 64
    config = ServerConfig(
        max_total_tokens=max(pool, 16),
        max_running_requests=max(batch_size, ServerConfig().max_running_requests),
        torch_threads=torch_threads,
        device=device,
        model_path=model_path,
        enable_deterministic_inference=deterministic,
    )
    if lora is not None:
        config = msgspec.structs.replace(
            config,
            enable_lora=True,
            lora_modules=lora.modules,
            max_loras=lora.max_loras,
            max_lora_rank=lora.max_lora_rank,
        )
    return build_scheduler(config)


def adapter_refs(scheduler: Scheduler) -> list[LoraRef]:
    """Each adapter the scheduler serves as a request names it (name and load id)."""
    lora = scheduler.runner.lora
    return [LoraRef(a.name, a.id) for a in lora.registry.adapters()] if lora is not None else []


def sampling_params(sampling: str, max_new_tokens: int, seed: int) -> SamplingParams:
    if sampling == "greedy":
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    if sampling == "sampled":
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=SAMPLED_TEMPERATURE,
            top_p=SAMPLED_TOP_P,
            seed=seed,
            ignore_eos=True,
        )
    raise ValueError(
        f"unknown sampling mode {sampling!r}; expected one of {', '.join(SAMPLING_MODES)}"
    )


def bench_schema(min_items: int) -> dict[str, Any]:
    """An array of at least ``min_items`` objects, each nested two deep (an object holding an
    object): every object takes several tokens, so no answer ends within ``min_items``
    tokens."""
    owner = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "since": {"type": "integer"}},
        "required": ["name", "since"],
    }
    meta = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"}, "owner": owner},
        "required": ["ok", "score", "owner"],
    }
    item = {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "meta": meta,
        },
        "required": ["id", "name", "tags", "meta"],
    }
    return {
        "type": "object",
        "properties": {"items": {"type": "array", "items": item, "minItems": min_items}},
        "required": ["items"],
    }


def submit(
    scheduler: Scheduler,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: str,
    seed: int,
    constraint: Constraint | None = None,
    loras: Sequence[LoraRef | None] = (),
) -> None:
    """Request i runs with ``loras[i % len(loras)]`` (none given: every one on the base)."""
    now = time.time()
    for i, ids in enumerate(prompts):
        # a distinct seed per request
        params = sampling_params(sampling, max_new_tokens, seed * 1_000_003 + i)
        scheduler.add_request(
            TokenizedGenerateReqInput(
                rid=f"bench-{i}",
                req_id=i,
                input_ids=ids,
                sampling_params=params,
                stream=True,
                arrival_time=now,
                constraint=constraint,
                lora=loras[i % len(loras)] if loras else None,
            )
        )


def await_grammars(scheduler: Scheduler, timeout: float = 60.0) -> None:
    """Steps until no request waits for its grammar (one compile, before the warm-up)."""
    deadline = time.monotonic() + timeout
    while scheduler.grammars:
        if time.monotonic() > deadline:
            raise RuntimeError("the benchmark's grammar did not compile")
        scheduler.step()
        time.sleep(0.001)


def decode_step(scheduler: Scheduler, batch_size: int) -> None:
    """One step that must be a pure decode over every request, emitting B rows."""
    frames = scheduler.step()
    if len(frames) != 1 or len(from_column(frames[0].req_ids, REQ_ID_DTYPE)) != batch_size:
        raise RuntimeError("a timed step was not one frame with a row per request")
