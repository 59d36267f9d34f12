"""The sampling parameters of docs/design.md section 10 against real servers: what they do to the
tokens a server generates, and the vocabulary check of ``logit_bias`` on a server without a
tokenizer.

A bias of 100 outweighs every logit of the built-in model, so with ``logit_bias {id: 100}``
every token generated is that id, greedy or sampled (bias comes before everything else)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.server_harness import ServerProcess

MODEL = "tokenpipe-tiny"
PROMPT = "Once upon a time"
TOKENS = 8
# Greedy, and sampled at temperature 1 with a seed (/generate's names; OpenAI's are the same).
SAMPLINGS: list[dict[str, Any]] = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 11}]


def _forced_token(http: httpx.Client) -> int:
    """An ordinary token (not EOS, not special): the last of a common word's ids."""
    token = int(
        http.post("/tokenize", json={"model": MODEL, "prompt": " time"}).json()["tokens"][-1]
    )
    assert token != 0  # the built-in model's EOS
    return token


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
def test_a_logit_bias_of_100_makes_every_generated_token_that_id(
    http: httpx.Client, oai: openai.OpenAI, sampling: dict[str, Any]
) -> None:
    forced = _forced_token(http)
    bias = {str(forced): 100.0}
    params = {"max_new_tokens": TOKENS, "ignore_eos": True, "logit_bias": bias, **sampling}
    out = http.post("/generate", json={"text": PROMPT, "sampling_params": params}).json()
    assert out["output_ids"] == [forced] * TOKENS, out

    completion = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=TOKENS,
        logit_bias=bias,
        extra_body={"ignore_eos": True},
        **sampling,
    )
    expected = http.post("/detokenize", json={"model": MODEL, "tokens": [forced] * TOKENS}).json()[
        "prompt"
    ]
    assert completion.usage is not None and completion.usage.completion_tokens == TOKENS
    assert completion.choices[0].text == expected, (completion.choices[0].text, expected)


EOS = 0  # the built-in model's


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "seeded"])
def test_min_new_tokens_keeps_eos_and_stop_ids_from_being_drawn(
    http: httpx.Client, oai: openai.OpenAI, sampling: dict[str, Any]
) -> None:
    """With a +100 bias every token would be the stop token; min_new_tokens 5 bans it (to
    -inf, as SGLang, vLLM and transformers do) for the first 5 draws, so the output is 5
    other tokens and then the stop, not 5 stop tokens that merely postpone the finish."""
    min_new = 5
    eos_pushed = {
        "max_new_tokens": TOKENS,
        "min_new_tokens": min_new,
        "logit_bias": {str(EOS): 100.0},
        **sampling,
    }
    out = http.post("/generate", json={"text": PROMPT, "sampling_params": eos_pushed}).json()
    assert EOS not in out["output_ids"][:min_new] and out["output_ids"][min_new:] == [EOS], out
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}, out
    assert (
        out["text"]
        == http.post(
            "/detokenize", json={"model": MODEL, "tokens": out["output_ids"][:min_new]}
        ).json()["prompt"]
    )

    stop = _forced_token(http)
    stop_pushed = {
        **eos_pushed,
        "logit_bias": {str(stop): 100.0},
        "stop_token_ids": [stop],
        "ignore_eos": True,
    }
    out = http.post("/generate", json={"text": PROMPT, "sampling_params": stop_pushed}).json()
    assert stop not in out["output_ids"][:min_new] and out["output_ids"][min_new:] == [stop], out
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}, out

    # OpenAI's name for it, through the same sampler.
    completion = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=TOKENS,
        logit_bias={str(EOS): 100},
        extra_body={"min_tokens": min_new},
        **sampling,
    )
    assert completion.usage is not None and completion.usage.completion_tokens == min_new + 1, (
        completion
    )
    assert completion.choices[0].finish_reason == "stop" and completion.choices[0].text, completion


# --- --skip-tokenizer-init: the vocabulary comes from the model's config ---------------------


@pytest.fixture(scope="module")
def ids_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    srv = ServerProcess(
        tmp_path_factory.mktemp("skip-tokenizer-sampling") / "tmp", ["--skip-tokenizer-init"]
    ).wait_ready()
    try:
        with srv.client() as client:
            yield client
    finally:
        srv.stop()


def test_logit_bias_ids_are_checked_against_the_vocabulary_without_a_tokenizer(
    ids_only: httpx.Client,
) -> None:
    vocab = ids_only.get("/model_info").json()["vocab_size"]
    params = {"max_new_tokens": 2, "ignore_eos": True}
    ok = ids_only.post(
        "/generate",
        json={
            "input_ids": [5, 6],
            "sampling_params": {**params, "logit_bias": {str(vocab - 1): 2}},
        },
    )
    assert ok.status_code == 200, ok.text
    refused = ids_only.post(
        "/generate",
        json={"input_ids": [5, 6], "sampling_params": {**params, "logit_bias": {str(vocab): 2}}},
    )
    assert (
        refused.status_code == 400
        and refused.json()["error"]["param"] == "sampling_params.logit_bias"
    ), refused.text
    completion = {"model": MODEL, "prompt": [5, 6], "max_tokens": 2, "logit_bias": {str(vocab): 2}}
    refused = ids_only.post("/v1/completions", json=completion)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logit_bias", (
        refused.text
    )
