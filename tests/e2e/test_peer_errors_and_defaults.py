"""Where vLLM and SGLang differ, on the shared server, with the official clients (docs/api.md,
"Errors in the peers' words" and "Defaults the peers differ on").

Errors: a refusal the two peers word differently carries both peers' phrases, the route's own
peer's first (SGLang's on /generate, vLLM's on the OpenAI routes), with their 400. The phrases
are read from the peers' code: vLLM's ``_validate_input`` (0.10.2 on), input processor and
``SamplingParams.verify``, and pydantic's words on both peers' OpenAI routes; SGLang's
tokenizer manager (``_validate_one_request``, ``_validate_input_ids_in_vocab``,
``_validate_token_ids_logprob``) and ``SamplingParams.verify``.

Defaults: ``continue_final_message`` alone leaves the last message open (vLLM refuses only
both fields sent true), the Responses API takes ``tool_choice`` "auto" or "none" without tools
(its default), and ``GET /v1/models/{id}`` answers the served name, by name or by path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

USER: Any = {"role": "user", "content": "Tell me a story"}
PREFILL: list[Any] = [USER, {"role": "assistant", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def card(http: httpx.Client) -> dict[str, Any]:
    """The served model's card: its name, path (``root``) and context."""
    model: dict[str, Any] = http.get("/v1/models").json()["data"][0]
    return model


@pytest.fixture(scope="module")
def vocab(http: httpx.Client) -> int:
    size: int = http.get("/model_info").json()["vocab_size"]
    return size


def _native_error(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    resp = http.post("/generate", json=body)
    assert resp.status_code == 400, resp.text
    error: dict[str, Any] = resp.json()["error"]
    return error


def _refused(call: Callable[[], object]) -> dict[str, Any]:
    """The official client's 400 for ``call``: its error object."""
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400
    error: dict[str, Any] = info.value.body  # type: ignore[assignment]
    return error


def _words(message: str, first: str, second: str) -> None:
    """``message`` leads with ``first`` and carries ``second`` after it."""
    assert message.startswith(first), message
    assert second in message[len(first) :], message


# --- errors in the peers' words ---------------------------------------------------------------


def _context_words(ctx: int, prompt: int, asked: int) -> tuple[str, str]:
    """(SGLang's, vLLM's) words for ``prompt`` tokens plus ``asked`` beyond ``ctx``."""
    if prompt >= ctx:
        return (
            f"The input ({prompt} tokens) is longer than the model's context length "
            f"({ctx} tokens).",
            f"This model's maximum context length is {ctx} tokens. However, your request has "
            f"{prompt} input tokens. Please reduce the length of the input messages.",
        )
    return (
        f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
        f"You requested a total of {prompt + asked} tokens: {prompt} tokens from the input "
        f"messages and {asked} tokens for the completion.",
        f"'max_tokens' or 'max_completion_tokens' is too large: {asked}. This model's maximum "
        f"context length is {ctx} tokens and your request has {prompt} input tokens "
        f"({asked} > {ctx} - {prompt}).",
    )


def test_a_context_overflow_carries_both_peers_words(
    http: httpx.Client, oai: openai.OpenAI, card: dict[str, Any]
) -> None:
    ctx, model = card["max_model_len"], card["id"]
    sglang_alone, vllm_alone = _context_words(ctx, ctx, 1)
    sglang_total, vllm_total = _context_words(ctx, 10, ctx)

    alone = _native_error(http, {"input_ids": [7] * ctx, "sampling_params": {"max_new_tokens": 1}})
    _words(alone["message"], sglang_alone, vllm_alone)
    total = _native_error(http, {"input_ids": [7] * 10, "sampling_params": {"max_new_tokens": ctx}})
    _words(total["message"], sglang_total, vllm_total)
    assert (alone["param"], total["param"]) == ("text", "sampling_params.max_new_tokens")

    alone = _refused(lambda: oai.completions.create(model=model, prompt=[7] * ctx, max_tokens=1))
    _words(alone["message"], vllm_alone, sglang_alone)
    total = _refused(lambda: oai.completions.create(model=model, prompt=[7] * 10, max_tokens=ctx))
    _words(total["message"], vllm_total, sglang_total)
    assert (alone["param"], total["param"]) == ("prompt", "max_tokens")
    # Chat's prompt is its template's, so only the words are checked; the Responses API
    # renames the fields in the detail and never a phrase ("messages", "max_completion_tokens").
    chat = _refused(
        lambda: oai.chat.completions.create(model=model, messages=[USER], max_tokens=ctx)
    )
    responses = _refused(
        lambda: oai.responses.create(model=model, input="hi", max_output_tokens=ctx)
    )
    for error, param in ((chat, "max_tokens"), (responses, "max_output_tokens")):
        _words(
            error["message"],
            f"'max_tokens' or 'max_completion_tokens' is too large: {ctx}. This model's maximum "
            f"context length is {ctx} tokens",
            f"Requested token count exceeds the model's maximum context length of {ctx} tokens",
        )
        assert "tokens from the input messages" in error["message"]
        assert error["param"] == param and f"{param}: {ctx})" in error["message"]


def test_token_ids_outside_the_vocabulary_carry_both_peers_words(
    http: httpx.Client, oai: openai.OpenAI, card: dict[str, Any], vocab: int
) -> None:
    """The prompt's ids, ``logit_bias`` and ``token_ids_logprob`` in both peers' words;
    ``stop_token_ids`` in vLLM's, a 400 as in vLLM (SGLang takes any)."""
    bad, model = vocab + 3, card["id"]
    sglang_prompt = f"The input_ids [{bad}] contains values greater than the vocab size ({vocab})."
    vllm_prompt = f"Token id {bad} is out of vocabulary."
    vllm_stop = (
        f"token_id(s) [{bad}] in stop_token_ids contain out-of-vocab token ids. "
        f"Vocabulary size: {vocab}."
    )
    prompt = _native_error(http, {"input_ids": [1, bad, 2]})
    _words(prompt["message"], sglang_prompt, vllm_prompt)
    stop = _native_error(http, {"text": "hi", "sampling_params": {"stop_token_ids": [3, bad]}})
    assert stop["message"].startswith(vllm_stop), stop
    assert stop["param"] == "sampling_params.stop_token_ids"
    logprob = _native_error(
        http, {"text": "hi", "return_logprob": True, "token_ids_logprob": [1, bad]}
    )
    _words(
        logprob["message"],
        f"token_ids_logprob contains out-of-vocabulary token id {bad}; valid range is "
        f"[0, {vocab}).",
        f"token_id(s) [{bad}] in logprob_token_ids contain out-of-vocab token ids.",
    )

    prompt = _refused(lambda: oai.completions.create(model=model, prompt=[1, bad, 2], max_tokens=1))
    _words(prompt["message"], vllm_prompt, sglang_prompt)
    assert prompt["param"] == "prompt" and "prompt position 1" in prompt["message"]
    stop = _refused(
        lambda: oai.completions.create(
            model=model, prompt="hi", max_tokens=1, extra_body={"stop_token_ids": [bad]}
        )
    )
    assert stop["message"].startswith(vllm_stop) and stop["param"] == "stop_token_ids"
    bias = _refused(
        lambda: oai.chat.completions.create(
            model=model, messages=[USER], max_tokens=1, logit_bias={str(bad): 1}
        )
    )
    _words(
        bias["message"],
        f"token_id(s) [{bad}] in logit_bias contain out-of-vocab token ids. "
        f"Vocabulary size: {vocab}.",
        f"logit_bias must has keys in [0, {vocab - 1}], got {bad}.",
    )
    assert bias["param"] == "logit_bias"


def test_a_nested_list_or_a_seed_out_of_range_carries_the_peers_words(
    http: httpx.Client, oai: openai.OpenAI, card: dict[str, Any]
) -> None:
    """Decode errors: msgspec's sentence, which names the field, after the peers' words."""
    model = card["id"]
    nested = _native_error(
        http, {"text": "hi", "return_logprob": True, "token_ids_logprob": [[1, 2]]}
    )
    _words(
        nested["message"],
        "token_ids_logprob must be a flat list of integers. Input should be a valid integer.",
        "- at `$.token_ids_logprob[0]`",
    )
    seed = _native_error(http, {"text": "hi", "sampling_params": {"seed": 2**63}})
    assert seed["message"].startswith(
        "Input should be less than or equal to 9223372036854775807."
    ), seed
    assert seed["param"] == "sampling_params.seed"

    nested = _refused(
        lambda: oai.completions.create(
            model=model, prompt="hi", max_tokens=1, extra_body={"stop_token_ids": [[1]]}
        )
    )
    _words(
        nested["message"],
        "Input should be a valid integer. stop_token_ids must be a flat list of integers.",
        "- at `$.stop_token_ids[0]`",
    )
    low = _refused(
        lambda: oai.chat.completions.create(
            model=model, messages=[USER], max_tokens=1, seed=-(2**63) - 1
        )
    )
    assert low["message"].startswith(
        "Input should be greater than or equal to -9223372036854775808."
    ), low
    high = _refused(
        lambda: oai.responses.create(model=model, input="hi", extra_body={"seed": 2**63})
    )
    assert high["message"].startswith(
        "Input should be less than or equal to 9223372036854775807."
    ), high
    assert low["param"] == high["param"] == "seed"


# --- defaults the peers differ on -------------------------------------------------------------


def _tokens(http: httpx.Client, **fields: Any) -> list[int]:
    resp = http.post("/tokenize", json={"messages": PREFILL, **fields})
    assert resp.status_code == 200, resp.text
    tokens: list[int] = resp.json()["tokens"]
    return tokens


def test_continue_final_message_alone_leaves_the_last_message_open(
    http: httpx.Client, oai: openai.OpenAI, card: dict[str, Any]
) -> None:
    """Not given, ``add_generation_prompt`` is false beside ``continue_final_message``: the
    prompt is the one with it sent false, on /tokenize and chat alike; both sent true is
    vLLM's 400."""
    open_ended = _tokens(http, add_generation_prompt=False, continue_final_message=True)
    assert _tokens(http, continue_final_message=True) == open_ended != _tokens(http)
    answer = oai.chat.completions.create(
        model=card["id"],
        messages=PREFILL,
        max_tokens=2,
        extra_body={"continue_final_message": True, "return_token_ids": True},
    )
    assert (answer.model_extra or {})["prompt_token_ids"] == open_ended
    assert answer.choices[0].message.role == "assistant"  # the last message's
    both = _refused(
        lambda: oai.chat.completions.create(
            model=card["id"],
            messages=PREFILL,
            max_tokens=2,
            extra_body={"continue_final_message": True, "add_generation_prompt": True},
        )
    )
    assert both["message"] == (
        "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    )
    assert both["param"] == "continue_final_message"


def test_the_responses_api_takes_tool_choice_auto_or_none_without_tools(
    oai: openai.OpenAI, card: dict[str, Any]
) -> None:
    """ "auto" is the Responses default (Codex sends it with no tools) and ``tools: []``
    vLLM's; chat keeps OpenAI's and vLLM's 400 for "auto" without tools, and "required"
    needs tools on both."""
    model = card["id"]
    cases: list[tuple[Any, Any]] = [("auto", {}), ("none", {}), ("auto", {"tools": []})]
    for choice, extra in cases:
        response = oai.responses.create(
            model=model, input="hi", max_output_tokens=2, tool_choice=choice, extra_body=extra
        )
        assert [item.type for item in response.output] == ["message"], response
    required = _refused(
        lambda: oai.responses.create(model=model, input="hi", tool_choice="required")
    )
    chat = _refused(
        lambda: oai.chat.completions.create(
            model=model, messages=[USER], max_tokens=2, tool_choice="auto"
        )
    )
    assert required["param"] == chat["param"] == "tool_choice"


def test_a_model_retrieved_by_name_or_path_answers_the_served_name(
    oai: openai.OpenAI, card: dict[str, Any]
) -> None:
    """SGLang's and vLLM's served name defaults to the model's path, so their users name a
    model by it; the card's id is always the served name, the one requests use."""
    served, path = card["id"], card["root"]
    assert path != served
    for name in (served, path):
        model = oai.models.retrieve(name)
        assert model.id == served and (model.model_extra or {})["root"] == path
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve(path + "-other")
