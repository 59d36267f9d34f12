"""Every field real clients send (SGLang's GenerateReqInput, CompletionRequest and
ChatCompletionRequest, OpenAI's requests, vLLM's extra sampling parameters) against a real
server: implemented fields work, known but unimplemented ones are accepted at their neutral
value and refused with a 400 naming them otherwise, and a field in none of the schemas is
still refused (docs/design.md section 12)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from pipeline.io_struct import SamplingParams
from pipeline.request_limits import MAX_STOP_TOKEN_IDS
from tokenizer_proc.native.schema import (
    GENERATE_REFUSED,
    SAMPLING_REFUSED,
    GenerateBody,
    GenerateRequest,
)
from tokenizer_proc.request_edge.body import decode_body
from tokenizer_proc.request_edge.bootstrap import bootstrap_of
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.request_edge.fields import MAX_LOGIT_BIAS
from tokenizer_proc.request_edge.known_fields import AsksUnlessNeutral, Refusal, is_neutral
from tokenizer_proc.openai.sampling_request import COMMON_REFUSED
from tokenizer_proc.openai.schema import (
    ChatCompletionBody,
    ChatCompletionRequest,
    CompletionBody,
    CompletionRequest,
)

MODEL = "tokenpipe-tiny"
MESSAGES = [{"role": "user", "content": "Tell me a story"}]

# The bodies sglang-router 0.3.2 sends for a plain client request: it re-serializes each body
# with its own defaults (captured from the router in front of a logging HTTP server).
ROUTER_GENERATE = {
    "text": "hi", "model": None, "sampling_params": {"max_new_tokens": 4},
    "return_text_in_logprobs": False, "stream": False, "log_metrics": True,
    "return_hidden_states": False, "background": False, "no_logs": False, "return_bytes": False,
    "return_entropy": False,
}  # fmt: skip
ROUTER_COMPLETION = {
    "model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": False, "echo": False,
    "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
    "return_hidden_states": False,
}  # fmt: skip
ROUTER_CHAT = {
    "messages": MESSAGES, "model": MODEL, "logprobs": False, "max_completion_tokens": 4,
    "stream": False, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
    "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
    "return_hidden_states": False,
}  # fmt: skip
ROUTES = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}


def _events(response: httpx.Response) -> list[dict[str, Any]]:
    lines = [
        line.removeprefix("data: ")
        for line in response.text.splitlines()
        if line.startswith("data: ")
    ]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _error(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    return response.json()["error"]  # type: ignore[no-any-return]


# --- the bodies real clients send -----------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_the_bodies_sglang_router_sends_are_served(http: httpx.Client, stream: bool) -> None:
    for route, body in (
        ("generate", ROUTER_GENERATE),
        ("completions", ROUTER_COMPLETION),
        ("chat", ROUTER_CHAT),
    ):
        response = http.post(ROUTES[route], json={**body, "stream": stream})
        assert response.status_code == 200, (route, response.text)
        if not stream:
            answer = response.json()
            tokens = (
                answer["meta_info"]["completion_tokens"]
                if route == "generate"
                else answer["usage"]["completion_tokens"]
            )
            assert 1 <= tokens <= 4
        else:
            assert _events(response)


def test_a_typo_is_ignored_and_named(http: httpx.Client) -> None:
    """A field in none of the schemas is ignored, as vLLM ignores it, and the answer names it
    (X-Ignored-Fields), so a typo still shows; --reject-unknown-fields refuses it
    (tests/e2e/test_request_leniency.py)."""
    for route, body in (
        ("generate", ROUTER_GENERATE),
        ("completions", ROUTER_COMPLETION),
        ("chat", ROUTER_CHAT),
    ):
        response = http.post(ROUTES[route], json={**body, "retrun_hidden_states": True})
        assert response.status_code == 200, response.text
        assert response.headers["x-ignored-fields"] == "retrun_hidden_states"


# --- known but not implemented: neutral accepted, anything else refused by name -------------


def _asking_value(neutrals: tuple[object, ...]) -> object:
    """A value that asks for something: the opposite of a neutral boolean, a neutral number
    moved, a list or object with an entry, or else a string."""
    candidates: list[object] = [not n for n in neutrals if isinstance(n, bool)]
    candidates += [
        n + 0.5 for n in neutrals if isinstance(n, (int, float)) and not isinstance(n, bool)
    ]
    candidates += [["x"], {"x": 1}, "x"]
    return next(c for c in candidates if not is_neutral(c, neutrals))


def _neutral(refusals: tuple[Refusal, ...]) -> list[tuple[str, tuple[object, ...]]]:
    """The ``known_fields.neutral`` entries of a table: each field and its neutral values."""
    return [
        (name, asks.values) for name, asks, _ in refusals if isinstance(asks, AsksUnlessNeutral)
    ]


NEUTRAL_CASES = (
    [("generate", name, None, values) for name, values in _neutral(GENERATE_REFUSED)]
    + [("generate", name, "sampling_params", values) for name, values in _neutral(SAMPLING_REFUSED)]
    + [
        ("completions", name, None, values)
        for name, values in _neutral(COMMON_REFUSED + CompletionRequest._REFUSED)
    ]
    + [("chat", name, None, values) for name, values in _neutral(ChatCompletionRequest._REFUSED)]
)


def _base(route: str) -> dict[str, Any]:
    if route == "generate":
        return {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    if route == "completions":
        return {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 1}


def _with(route: str, nested: str | None, name: str, value: object) -> dict[str, Any]:
    body = _base(route)
    if nested is None:
        body[name] = value
    else:
        body[nested] = {**body[nested], name: value}
    return body


@pytest.mark.parametrize(
    ("route", "name", "nested", "neutrals"),
    NEUTRAL_CASES,
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_a_known_field_is_served_at_its_neutral_value_and_refused_by_name_otherwise(
    http: httpx.Client, route: str, name: str, nested: str | None, neutrals: tuple[object, ...]
) -> None:
    for value in (None, *neutrals):
        response = http.post(ROUTES[route], json=_with(route, nested, name, value))
        assert response.status_code == 200, (name, value, response.text)
    asking = _asking_value(neutrals)
    error = _error(http.post(ROUTES[route], json=_with(route, nested, name, asking)))
    path = name if nested is None else f"{nested}.{name}"
    assert error["param"] == path and error["message"].startswith(
        f"{path} is not supported by this server"
    )


def test_booleans_and_numbers_are_not_each_others_neutral_values(http: httpx.Client) -> None:
    # 0 == False in Python; a client that sends 0 for a boolean flag asked for something odd.
    assert (
        _error(http.post("/generate", json={**_base("generate"), "return_hidden_states": 0}))[
            "param"
        ]
        == "return_hidden_states"
    )
    # 1 is 1.0: a neutral repetition_penalty sent as an integer is fine.
    assert (
        http.post(
            "/v1/completions", json={**_base("completions"), "repetition_penalty": 1}
        ).status_code
        == 200
    )


# --- implemented fields ------------------------------------------------------------------------


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(http: httpx.Client) -> None:
    for route, body in (
        ("completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6}),
        ("chat", {"model": MODEL, "messages": MESSAGES, "max_tokens": 6}),
    ):
        options = {"include_usage": True, "continuous_usage_stats": True}
        events = _events(
            http.post(
                ROUTES[route],
                json={**body, "ignore_eos": True, "stream": True, "stream_options": options},
            )
        )
        *chunks, last = events
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
        prompt = last["usage"]["prompt_tokens"]
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert all(c["usage"]["prompt_tokens"] == prompt for c in chunks)
        assert all(
            c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"] for c in chunks
        )
        assert counts == sorted(counts) and counts[-1] == 6
        if route == "chat":
            assert counts[0] == 0  # the opening chunk (the role) comes before any token
        # Without continuous_usage_stats the chunks carry null, as OpenAI sends them.
        plain = _events(
            http.post(
                ROUTES[route],
                json={**body, "stream": True, "stream_options": {"include_usage": True}},
            )
        )
        assert all(c["usage"] is None for c in plain[:-1])


def test_max_completion_tokens_bounds_a_chat_answer(http: httpx.Client) -> None:
    answer = http.post(
        ROUTES["chat"],
        json={"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 3, "ignore_eos": True},
    ).json()
    assert (
        answer["usage"]["completion_tokens"] == 3
        and answer["choices"][0]["finish_reason"] == "length"
    )


def test_no_stop_trim_keeps_the_stop_string(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    text = http.post(ROUTES["completions"], json=body).json()["choices"][0]["text"]
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), text
    trimmed = http.post(ROUTES["completions"], json={**body, "stop": [stop]}).json()["choices"][0]
    kept = http.post(
        ROUTES["completions"], json={**body, "stop": [stop], "no_stop_trim": True}
    ).json()["choices"][0]
    assert trimmed["finish_reason"] == kept["finish_reason"] == "stop"
    # As SGLang: the text of every token through the one that completed the stop string.
    assert kept["text"].startswith(trimmed["text"] + stop) and text.startswith(kept["text"])


def test_sampling_seed_is_sglangs_name_for_seed(http: httpx.Client) -> None:
    params = {"max_new_tokens": 8, "temperature": 1.0}
    seeded = http.post(
        "/generate", json={"text": "hi", "sampling_params": {**params, "seed": 7}}
    ).json()
    aliased = http.post(
        "/generate", json={"text": "hi", "sampling_params": {**params, "sampling_seed": 7}}
    ).json()
    assert seeded["output_ids"] == aliased["output_ids"]
    error = _error(
        http.post(
            "/generate",
            json={"text": "hi", "sampling_params": {**params, "seed": 7, "sampling_seed": 8}},
        )
    )
    assert error["param"] == "sampling_params.sampling_seed"


def test_generate_takes_the_served_model_name_or_null(http: httpx.Client) -> None:
    assert http.post("/generate", json={**_base("generate"), "model": MODEL}).status_code == 200
    response = http.post("/generate", json={**_base("generate"), "model": "another-model"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"


# --- the sampling parameters of docs/design.md section 10 -----------------------------------------

# A value of each that asks for something. /generate takes them all in sampling_params
# (SGLang's names); the official client takes OpenAI's names as its own arguments and vLLM's
# (top_k, min_p, repetition_penalty) in extra_body.
ASKING: dict[str, Any] = {
    "min_p": 0.05,
    "frequency_penalty": 0.5,
    "presence_penalty": -0.5,
    "repetition_penalty": 1.3,
    "logit_bias": {"17": 3.0, "5": -2.0},
    "top_k": 20,
}
OPENAI_OWN = {"frequency_penalty", "presence_penalty", "logit_bias", "temperature", "top_p"}
# The fields that were neutral-only before the sampler implemented them; null is their neutral
# value.
NULLABLE = ("min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias")

# Values every route refuses with a 400 naming the field.
REFUSED_VALUES: list[tuple[str, Any]] = [
    ("min_p", -0.1),
    ("min_p", 1.01),
    ("frequency_penalty", -2.01),
    ("frequency_penalty", 2.5),
    ("presence_penalty", -2.5),
    ("presence_penalty", 2.01),
    ("repetition_penalty", 0),  # a positive logit is divided by it
    ("repetition_penalty", -1.0),
    ("repetition_penalty", 2.01),
    ("temperature", -0.1),
    ("top_p", 0),
    ("top_p", 1.01),
    ("top_k", 0),
    ("top_k", -2),
    ("logit_bias", {"1": 100.5}),
    ("logit_bias", {"1": -101}),
    ("logit_bias", {"1": "strong"}),
    ("logit_bias", {"hello": 1}),
    ("logit_bias", {"1.5": 1}),
    ("logit_bias", {"-1": 1}),
    ("logit_bias", {"": 1}),
    ("logit_bias", {"1": 1, "001": 1}),  # one token id twice
    ("logit_bias", {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}),
    ("logit_bias", [[1, 5.0]]),
    # Bounded as logit_bias is: the running batch shares a stop table as wide as its widest list.
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1))),
]


def _refused_id(case: object) -> str:
    name, value = case  # type: ignore[misc]
    shown = json.dumps(value)
    return f"{name}={shown if len(shown) < 30 else f'{len(value)} entries'}"


def _generate(http: httpx.Client, fields: dict[str, Any]) -> httpx.Response:
    return http.post(
        "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2, **fields}}
    )


def _openai(oai: openai.OpenAI, route: str, fields: dict[str, Any]) -> Any:
    """A request through the official client: OpenAI's names as its own arguments, the rest
    in extra_body."""
    kwargs: dict[str, Any] = {k: v for k, v in fields.items() if k in OPENAI_OWN}
    extra = {k: v for k, v in fields.items() if k not in OPENAI_OWN}
    if extra:
        kwargs["extra_body"] = extra
    if route == "completions":
        return oai.completions.create(model=MODEL, prompt="hi", max_tokens=2, **kwargs)
    return oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=2,
        **kwargs,
    )


@pytest.mark.parametrize(
    "fields", [{name: value} for name, value in ASKING.items()] + [ASKING], ids=[*ASKING, "all"]
)
def test_the_sampling_parameters_are_served_on_every_route(
    http: httpx.Client, oai: openai.OpenAI, fields: dict[str, Any]
) -> None:
    response = _generate(http, fields)
    assert response.status_code == 200, response.text
    assert response.json()["meta_info"]["completion_tokens"] >= 1
    assert _openai(oai, "completions", fields).usage.completion_tokens >= 1
    assert _openai(oai, "chat", fields).usage.completion_tokens >= 1


def test_null_is_each_sampling_parameters_neutral_value(
    http: httpx.Client, oai: openai.OpenAI
) -> None:
    nulls = dict.fromkeys(NULLABLE)
    assert _generate(http, nulls).status_code == 200
    assert _openai(oai, "completions", nulls).choices and _openai(oai, "chat", nulls).choices
    neutral = SamplingParams()
    expected = tuple(getattr(neutral, name) for name in NULLABLE)
    generate: GenerateRequest = decode_body(
        json.dumps({"text": "hi", "sampling_params": nulls}).encode(), GenerateBody
    )  # type: ignore[assignment]
    completion: CompletionRequest = decode_body(
        json.dumps({"prompt": "hi", **nulls}).encode(), CompletionBody
    )  # type: ignore[assignment]
    for wire in (generate.sampling_params.to_wire(), completion.sampling(4)[0]):
        assert (
            tuple(getattr(wire, name) for name in NULLABLE) == expected == (0.0, 0.0, 0.0, 1.0, ())
        )


def test_the_sampling_parameters_reach_the_wire_with_logit_bias_sorted_by_id() -> None:
    values = {name: ASKING[name] for name in NULLABLE}
    expected = (0.05, 0.5, -0.5, 1.3, ((5, -2.0), (17, 3.0)))
    generate: GenerateRequest = decode_body(
        json.dumps({"text": "hi", "sampling_params": values}).encode(), GenerateBody
    )  # type: ignore[assignment]
    wire = generate.sampling_params.to_wire()
    assert tuple(getattr(wire, name) for name in NULLABLE) == expected
    chat: ChatCompletionRequest = decode_body(
        json.dumps({"messages": MESSAGES, "n": 3, "seed": 7, **values}).encode(), ChatCompletionBody
    )  # type: ignore[assignment]
    choices = chat.sampling(4)
    assert [c.seed for c in choices] == [7, 8, 9]
    assert all(tuple(getattr(c, name) for name in NULLABLE) == expected for c in choices)


@pytest.mark.parametrize(
    ("name", "value"), REFUSED_VALUES, ids=[_refused_id(c) for c in REFUSED_VALUES]
)
def test_an_out_of_range_sampling_parameter_is_refused_by_name(
    http: httpx.Client, oai: openai.OpenAI, name: str, value: Any
) -> None:
    error = _error(_generate(http, {name: value}))
    assert error["param"] == f"sampling_params.{name}" and name in error["message"], error
    for route in ("completions", "chat"):
        with pytest.raises(openai.BadRequestError) as info:
            _openai(oai, route, {name: value})
        error = info.value.body  # type: ignore[assignment]
        assert error["param"] == name and name in error["message"], (route, error)


def test_stop_token_ids_up_to_the_bound_are_served_on_every_route(
    http: httpx.Client, oai: openai.OpenAI
) -> None:
    most = {"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS))}
    assert _generate(http, most).status_code == 200
    assert _openai(oai, "completions", most).choices and _openai(oai, "chat", most).choices


def test_logit_bias_ids_must_be_below_the_vocabulary_size(
    http: httpx.Client, oai: openai.OpenAI
) -> None:
    vocab = http.get("/model_info").json()["vocab_size"]
    last, beyond = {str(vocab - 1): 1.0, "0": -1.0}, {"3": 1.0, str(vocab): 1.0}
    assert _generate(http, {"logit_bias": last}).status_code == 200
    sglang = f"logit_bias must has keys in [0, {vocab - 1}], got {vocab}."
    vllm = f"token_id(s) [{vocab}] in logit_bias contain out-of-vocab token ids."
    error = _error(_generate(http, {"logit_bias": beyond}))
    assert error["param"] == "sampling_params.logit_bias", error
    assert error["message"].startswith(sglang) and vllm in error["message"], error
    for route in ("completions", "chat"):
        assert _openai(oai, route, {"logit_bias": last}).choices
        with pytest.raises(openai.BadRequestError) as info:
            _openai(oai, route, {"logit_bias": beyond})
        error = info.value.body  # type: ignore[assignment]
        assert error["param"] == "logit_bias", (route, error)
        assert error["message"].startswith(vllm) and sglang in error["message"], (route, error)


def test_bootstrap_fields_come_as_scalars_or_one_entry_lists() -> None:
    scalar = bootstrap_of(5, None, "10.0.0.1", 9000)
    assert scalar is not None and scalar.room == 5 and scalar.endpoint == "tcp://10.0.0.1:9000"
    assert bootstrap_of([5], None, ["10.0.0.1"], [9000]) == scalar
    with pytest.raises(RequestValidationError, match="one prompt") as info:
        bootstrap_of([5, 6], None, ["10.0.0.1", "10.0.0.2"], [9000, 9000])
    assert info.value.param == "bootstrap_room"
