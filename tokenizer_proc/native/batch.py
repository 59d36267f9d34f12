"""A /generate batch, as SGLang defines one: ``text`` as a list of prompts, or ``input_ids``
as a list of id lists; ``sampling_params`` and ``lora_path`` one for all or a list of one per
item; ``rid`` a list of one per item, or one string that item ``i`` gets as ``{rid}_{i}``.

Each item is the single request it stands for: its body is the batch's with the item's
prompt, sampling parameters and rid in place, decoded and checked by the same code as a
single request's. Every item is checked before any is submitted, so one bad item refuses
the whole batch (a 400 naming it, ``text[3]`` or ``sampling_params[2].temperature``) and
nothing of it runs.

A single request never comes here: /generate decodes its body as one first, and looks for
a batch only when that fails (``batch_body``), so the single path pays nothing for batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import Request

from pipeline.io_struct import Constraint, LoraRef, SamplingParams
from tokenizer_proc.http.common import abort_unfinished, trace_context
from tokenizer_proc.lora_names import UnknownModel
from tokenizer_proc.media import expand_prompt, parse_media
from tokenizer_proc.native.schema import GenerateBody, GenerateRequest
from tokenizer_proc.request_edge.body import convert_body
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.req_state import ReqState
from pipeline.peer_errors import duplicate_rid_message
from tokenizer_proc.tokenizer_manager import TokenizerManager

MAX_BATCH = 1024
"""Items of one batch: each is a live request, as many as a full queue's worth at most."""
_PER_ITEM = ("text", "input_ids", "sampling_params", "rid", "lora_path")
# Fields a batch item cannot carry one per item here: media (one list per prompt in SGLang)
# and PD's bootstrap room (one per request). Sent as single requests they work.
_SINGLE_ONLY = (
    "image_data",
    "audio_data",
    "video_data",
    "bootstrap_room",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_endpoint",
)


def batch_body(body: bytes) -> dict[str, Any] | None:
    """The decoded body when it is a batch (``text`` a list, or ``input_ids`` a list of
    lists); None otherwise, when the single request's own error stands."""
    try:
        obj = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    text, ids = obj.get("text"), obj.get("input_ids")
    if isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        return obj
    return None


@dataclass(frozen=True, slots=True)
class BatchItem:
    """One item made ready to submit: its decoded request and what ``submit_generate`` takes."""

    obj: GenerateRequest
    input_ids: list[int]
    sampling: SamplingParams
    constraint: Constraint | None
    rid: str | None
    lora: LoraRef | None


def batch_items(
    tm: TokenizerManager, body: dict[str, Any], ignored: list[str] | None
) -> list[BatchItem]:
    """Every item decoded and checked as its single request would be, in order (the unknown
    fields each ignores noted in ``ignored``, named within the batch). Raises
    RequestValidationError naming the first bad item's field; nothing is submitted."""
    prompts_field = "text" if body.get("text") is not None else "input_ids"
    if body.get("text") is not None and body.get("input_ids") is not None:
        raise RequestValidationError("give exactly one of `text` and `input_ids`", "text")
    prompts = body[prompts_field]
    if not isinstance(prompts, list) or not 1 <= len(prompts) <= MAX_BATCH:
        raise RequestValidationError(
            f"a batch holds 1 to {MAX_BATCH} prompts; `{prompts_field}` has {len(prompts)}",
            prompts_field,
        )
    n = len(prompts)
    for name in _SINGLE_ONLY:
        if body.get(name) is not None:
            raise RequestValidationError(
                f"{name} is not served in a batch here; send these prompts as single requests", name
            )
    sampling = body.get("sampling_params")
    rid = body.get("rid")
    lora_path = body.get("lora_path")
    for name, value in (("sampling_params", sampling), ("rid", rid), ("lora_path", lora_path)):
        if isinstance(value, list) and len(value) != n:
            raise RequestValidationError(
                f"{name} has {len(value)} entries for {n} prompts: give one per prompt, or one "
                "for all",
                name,
            )
    # One string for all: item i's is "{rid}_{i}", as SGLang names them (anything else is
    # left to the item's own type check).
    rids: list[Any] = (
        rid
        if isinstance(rid, list)
        else [f"{rid}_{i}" if isinstance(rid, str) else rid for i in range(n)]
    )
    listed = {
        prompts_field,
        *(
            name
            for name in ("sampling_params", "rid", "lora_path")
            if isinstance(body.get(name), list)
        ),
    }
    items = [
        _item(tm, body, i, prompts_field, prompts[i], sampling, rids[i], listed, ignored)
        for i in range(n)
    ]
    _check_rids(tm, items, "rid" in listed)
    return items


def _item(
    tm: TokenizerManager,
    body: dict[str, Any],
    i: int,
    prompts_field: str,
    prompt: Any,
    sampling: Any,
    rid: Any,
    listed: set[str],
    ignored: list[str] | None,
) -> BatchItem:
    """Item ``i``: the batch's body with its own per-item fields, checked as a single request
    is by /generate and ``submit_generate`` (in that order), its errors naming the item."""
    single = dict(body)
    single[prompts_field] = prompt
    single["sampling_params"] = sampling[i] if isinstance(sampling, list) else sampling
    single["rid"] = rid
    lora_path = body.get("lora_path")
    single["lora_path"] = lora_path[i] if isinstance(lora_path, list) else lora_path
    for name in _PER_ITEM:
        if single.get(name) is None:
            single.pop(name, None)  # absent, as in a single request: the field's default
    own: list[str] | None = [] if ignored is not None else None
    try:
        obj = convert_body(single, GenerateBody, own)
        if ignored is not None and own:
            ignored.extend(_within_batch(path, i, listed) for path in own)
        obj.refuse_unsupported()
        lora = _item_lora(tm, obj)
        wire = obj.sampling_params.to_wire()
        constraint = obj.sampling_params.constraint()
        media = parse_media(obj.image_data, obj.audio_data, obj.video_data)
        prompt_ids = tm.checks.tokenize(obj.text, obj.input_ids, add_special_tokens=True)
        input_ids = expand_prompt(prompt_ids, media, tm.checks.media_token_ids(media))
        if tm.config.mode == "embedding":
            raise RequestValidationError(
                "this server runs --mode embedding: use /v1/embeddings or /encode, or start a "
                "server in --mode generate",
                "model",
            )
        checked, _ = tm.checks.pd_half(wire, obj.bootstrap(), internal=False)
        tm.checks.validate_sampling(len(input_ids), checked)
        tm.checks.validate_logprobs(obj.logprob_params())
        tm.checks.validate_constraint(constraint)
    except RequestValidationError as exc:
        raise _naming_item(exc, i, listed) from exc
    return BatchItem(obj, input_ids, wire, constraint, obj.rid, lora)


def _item_lora(tm: TokenizerManager, obj: GenerateRequest) -> LoraRef | None:
    """The item's adapter; an unknown ``model`` is the item's 400 here (the batch's other
    items are checked the same way, and one bad item refuses the batch)."""
    try:
        return tm.loras.resolve(obj.model, obj.lora_path)
    except UnknownModel as exc:
        raise RequestValidationError(str(exc), "model") from exc


def _within_batch(path: str, i: int, listed: set[str]) -> str:
    """Item ``i``'s path within the batch: ``sampling_params[i].bar`` where the batch lists
    the field (one per item); a field the items share keeps its own path."""
    head = path.split(".", 1)[0].split("[", 1)[0]
    return f"{head}[{i}]{path[len(head) :]}" if head in listed else path


def _naming_item(exc: RequestValidationError, i: int, listed: set[str]) -> RequestValidationError:
    """``exc`` of item ``i``, its field named within the batch: ``text`` -> ``text[i]``,
    ``sampling_params.top_p`` -> ``sampling_params[i].top_p`` (when the batch lists them);
    the message starts with that name, so a field the items share still says which item."""
    param, message = exc.param, str(exc)
    if param == "text" and "input_ids" in listed:  # the prompt checks name `text` for either
        param = "input_ids"
    head = (param or "").split(".", 1)[0].split("[", 1)[0]
    if param is not None and head in listed:
        param = f"{head}[{i}]{param[len(head) :]}"
        message = message.replace(f"`$.{head}", f"`$.{head}[{i}]")
    where = (
        param
        if param is not None and head in listed
        else f"batch item {i}" + (f" ({param})" if param else "")
    )
    return RequestValidationError(f"{where}: {message}", param)


def _check_rids(tm: TokenizerManager, items: list[BatchItem], listed: bool) -> None:
    """A rid used twice in the batch, or by a live request, refuses the batch (as
    ``open_state`` refuses a single request's), before anything is submitted."""
    seen: dict[str, int] = {}
    for i, item in enumerate(items):
        rid = item.rid
        if rid is None:
            continue
        param = f"rid[{i}]" if listed else "rid"
        if rid in seen:
            raise RequestValidationError(
                f"{param}: Duplicate request IDs detected within the request: [{rid!r}] (rid[{i}] "
                f"repeats rid[{seen[rid]}])",
                param,
            )
        if rid in tm.rid_to_req_id:
            raise RequestValidationError(f"{param}: {duplicate_rid_message(rid)}", param)
        seen[rid] = i


def submit_batch(
    tm: TokenizerManager, request: Request, items: list[BatchItem], stream: bool, arrived: float
) -> list[ReqState]:
    """Submits every item, in order, and returns their states. The items were checked
    (``batch_items``) with nothing awaited since, so none is refused here; should one be,
    those already submitted are aborted."""
    trace = trace_context(request)
    states: list[ReqState] = []
    try:
        for item in items:
            states.append(
                tm.submit_generate(
                    input_ids=item.input_ids,
                    sampling=item.sampling,
                    stream=stream,
                    rid=item.rid,
                    trace=trace,
                    created_time=arrived,
                    route="/generate",
                    logprobs=item.obj.logprob_params(),
                    constraint=item.constraint,
                    cache_salt=item.obj.cache_salt,
                    priority=item.obj.priority or 0,
                    lora=item.lora,
                )
            )
    except BaseException:
        abort_unfinished(tm, states)
        raise
    return states
