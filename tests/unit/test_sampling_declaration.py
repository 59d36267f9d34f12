"""Each field of ``SamplingParams`` is declared once: the scheduler carries it by the table in
scheduler_proc/sampling/param_columns.py (a running-batch column, or a named other way), a
column's neutral value is the wire's default, and each dialect's request body spells the field
(or says, in ``DIALECTS``, why it does not) and brings its value to the wire. A field added to
``SamplingParams`` and forgotten in one of those places fails here, naming the field.
docs/design/adding-a-sampling-parameter.md: the checklist."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from pipeline.io_struct import SamplingParams
from scheduler_proc.batch.running_batch import RunningBatch
from scheduler_proc.req import Req, StatsPending
from scheduler_proc.sampling.param_columns import (
    CARRIED_OTHERWISE,
    PARAM_COLUMNS,
    SAMPLER_COLUMNS,
    uncarried_fields,
)
from scheduler_proc.sampling.sampler import SamplingColumns
from tokenizer_proc.native.schema import GenerateSamplingParams
from tokenizer_proc.openai.responses.request import ResponsesRequest
from tokenizer_proc.openai.schema import ChatCompletionRequest, CompletionRequest

FIELDS: tuple[str, ...] = SamplingParams.__struct_fields__

# A value of each field that differs from its default and that every dialect accepts, as a
# JSON body spells it; ``wire`` below turns it into the value SamplingParams carries.
EXAMPLES: dict[str, Any] = {
    "max_new_tokens": 7,
    "min_new_tokens": 2,
    "temperature": 0.5,
    "top_p": 0.75,
    "top_k": 5,
    "seed": 11,
    "stop_token_ids": [3, 4],
    "stop": ["xy"],
    "ignore_eos": True,
    "stream_interval": 3,
    "skip_special_tokens": False,
    "no_stop_trim": True,
    "min_p": 0.125,
    "frequency_penalty": 0.5,
    "presence_penalty": 0.25,
    "repetition_penalty": 1.5,
    "logit_bias": {"5": 1.0},
    "thinking_budget": 4,
    "thinking_end": [7, 8],
}


def wire(name: str) -> Any:
    value = EXAMPLES[name]
    if name == "logit_bias":
        return tuple((int(k), v) for k, v in sorted(value.items()))
    return tuple(value) if isinstance(value, list) else value


def carried_check(fields: tuple[str, ...]) -> None:
    missing = uncarried_fields(fields)
    assert not missing, "\n".join(
        f"SamplingParams.{name} is declared but carried neither into a running-batch column "
        "(param_columns.PARAM_COLUMNS) nor another way (param_columns.CARRIED_OTHERWISE)"
        for name in missing
    )


# --- (a) every field is carried by the scheduler ------------------------------------------


def test_every_sampling_field_is_carried_by_the_scheduler() -> None:
    carried_check(FIELDS)
    assert set(EXAMPLES) == set(FIELDS), "EXAMPLES needs one value per SamplingParams field"


def test_a_field_declared_but_not_carried_fails_naming_it() -> None:
    class WithTypicalP(SamplingParams, frozen=True):
        typical_p: float = 1.0

    with pytest.raises(AssertionError, match=r"SamplingParams\.typical_p is declared"):
        carried_check(WithTypicalP.__struct_fields__)


def test_the_declaration_names_only_real_fields_each_once() -> None:
    columns = [c.field for c in PARAM_COLUMNS]
    assert len(columns) == len(set(columns))
    assert not set(columns) & set(CARRIED_OTHERWISE), "a field is both a column and not"
    stale = (set(columns) | set(CARRIED_OTHERWISE)) - set(FIELDS)
    assert not stale, f"declared for fields SamplingParams does not have: {sorted(stale)}"


def joined_req(sampling: SamplingParams) -> Req:
    req = Req(
        rid="r0",
        req_id=0,
        input_ids=[1, 2, 3],
        sampling=sampling,
        stream=True,
        stream_interval=1,
        arrival_time=time.time(),
        stats_pending=StatsPending(),
    )
    req.output_ids.append(4)
    req.num_computed = req.seq_len - 1
    req.kv_slots = torch.arange(req.num_computed)
    return req


def test_the_running_batch_and_the_sampler_carry_every_column() -> None:
    """A request's value of each declared column lands in its row, in the sampler's columns
    built from the batch, and in those built from the request (the event path)."""
    sampling = SamplingParams(**{c.field: wire(c.field) for c in PARAM_COLUMNS})
    batch = RunningBatch(context_length=32, vocab_size=16)
    batch.append(joined_req(sampling))
    for column in PARAM_COLUMNS:
        assert batch.params[column.field][0] == wire(column.field), column.field
        assert batch.params[column.field].dtype == column.dtype, column.field
    sampler_fields = {f.name for f in dataclasses.fields(SamplingColumns)}
    from_batch = batch.sampling_columns()
    from_request = SamplingColumns.from_requests([sampling], [0], [0], [[1]], [[4]], 16, "cpu")
    for column in SAMPLER_COLUMNS:
        assert column.field in sampler_fields, f"SamplingColumns has no {column.field}"
        assert getattr(from_batch, column.field).tolist() == [wire(column.field)]
        assert getattr(from_request, column.field).tolist() == [wire(column.field)]


# --- (c) defaults agree ---------------------------------------------------------------------


def test_each_columns_neutral_value_is_the_wire_default() -> None:
    defaults = SamplingParams()
    for column in PARAM_COLUMNS:
        if column.neutral is not None:
            assert getattr(defaults, column.field) == column.neutral, column.field


# --- (b) each dialect spells the fields -----------------------------------------------------


@dataclass(frozen=True)
class Dialect:
    name: str
    body: type[msgspec.Struct]
    renamed: dict[str, str] = field(default_factory=dict)  # SamplingParams field -> its name
    # Fields the dialect does not expose, each with why: a request gets the wire's default.
    not_exposed: dict[str, str] = field(default_factory=dict)

    def spelling(self, name: str) -> str:
        return self.renamed.get(name, name)

    def gaps(self, fields: tuple[str, ...]) -> list[str]:
        """A line per field the dialect neither spells nor lists as not exposed, and per
        listed field that it does spell after all."""
        spelled = set(self.body.__struct_fields__)
        out = []
        for name in fields:
            if name in self.not_exposed:
                if self.spelling(name) in spelled:
                    out.append(f"{self.name}: {name} is listed as not exposed but is spelled")
            elif self.spelling(name) not in spelled:
                out.append(f"{self.name}: no request field for SamplingParams.{name}")
        return out


_NO_STREAM_INTERVAL = "OpenAI's and vLLM's schemas have none: the server's --stream-interval"
# Set by the Anthropic route only (SGLang's max_thinking_tokens stays a refused field).
_THINKING = {
    "thinking_budget": "only the Anthropic route's thinking.budget_tokens sets it",
    "thinking_end": "set with thinking_budget, from the tokenizer's </think>",
}
DIALECTS = (
    Dialect("native sampling_params", GenerateSamplingParams, not_exposed=_THINKING),
    Dialect(
        "OpenAI completions",
        CompletionRequest,
        renamed={"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"},
        not_exposed={"stream_interval": _NO_STREAM_INTERVAL, **_THINKING},
    ),
    Dialect(
        "OpenAI chat completions",
        ChatCompletionRequest,
        renamed={"max_new_tokens": "max_completion_tokens", "min_new_tokens": "min_tokens"},
        not_exposed={"stream_interval": _NO_STREAM_INTERVAL, **_THINKING},
    ),
    # OpenAI's Responses fields, with vLLM's extras (seed, top_k, min_p, repetition_penalty,
    # logit_bias, skip_special_tokens): neither has the others.
    Dialect(
        "Responses",
        ResponsesRequest,
        renamed={"max_new_tokens": "max_output_tokens"},
        not_exposed={
            "min_new_tokens": "not in OpenAI's Responses API nor vLLM's extras",
            "stop_token_ids": "not in OpenAI's Responses API nor vLLM's extras",
            "stop": "not in OpenAI's Responses API nor vLLM's extras",
            "ignore_eos": "not in OpenAI's Responses API nor vLLM's extras",
            "stream_interval": _NO_STREAM_INTERVAL,
            "no_stop_trim": "not in OpenAI's Responses API nor vLLM's extras",
            "frequency_penalty": "not in OpenAI's Responses API nor vLLM's extras",
            "presence_penalty": "not in OpenAI's Responses API nor vLLM's extras",
            **_THINKING,
        },
    ),
)


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.name)
def test_each_dialect_spells_every_sampling_field_it_exposes(dialect: Dialect) -> None:
    gaps = dialect.gaps(FIELDS)
    assert not gaps, "\n".join(gaps)


def test_a_field_no_dialect_spells_is_named() -> None:
    fields = (*FIELDS, "typical_p")
    assert DIALECTS[0].gaps(fields) == [
        "native sampling_params: no request field for SamplingParams.typical_p"
    ]


def to_wire(dialect: Dialect, sampling: dict[str, Any]) -> SamplingParams:
    """The wire SamplingParams a body of ``dialect`` with these fields becomes."""
    if dialect.body is GenerateSamplingParams:
        return msgspec.convert(sampling, GenerateSamplingParams).to_wire()
    if dialect.body is CompletionRequest:
        completion = msgspec.convert({"prompt": "hi", **sampling}, CompletionRequest)
        return completion.sampling(completion.max_output())[0]
    messages = [{"role": "user", "content": "hi"}]
    if dialect.body is ChatCompletionRequest:
        chat = msgspec.convert({"messages": messages, **sampling}, ChatCompletionRequest)
    else:
        responses = msgspec.convert({"input": "hi", **sampling}, ResponsesRequest)
        chat = responses.to_chat(messages)
    return chat.sampling(chat.requested_max_tokens() or 16)[0]


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.name)
def test_each_dialect_brings_each_field_to_the_wire(dialect: Dialect) -> None:
    exposed = [name for name in FIELDS if name not in dialect.not_exposed]
    sent = to_wire(dialect, {dialect.spelling(name): EXAMPLES[name] for name in exposed})
    for name in exposed:
        assert getattr(sent, name) == wire(name), f"{dialect.name}: {name}"


@pytest.mark.parametrize("dialect", DIALECTS, ids=lambda d: d.name)
def test_a_field_left_out_gets_the_wire_default(dialect: Dialect) -> None:
    """Every field but the output limit (each dialect has its own default there)."""
    sent, defaults = to_wire(dialect, {}), SamplingParams()
    for name in FIELDS:
        if name != "max_new_tokens":
            assert getattr(sent, name) == getattr(defaults, name), f"{dialect.name}: {name}"


def test_the_examples_differ_from_the_defaults() -> None:
    defaults = SamplingParams()
    same = [name for name in FIELDS if wire(name) == getattr(defaults, name)]
    assert not same, f"EXAMPLES must differ from the defaults: {same}"
    assert np.float32(wire("top_p")) == wire("top_p"), "examples exact in float32"
