"""SGLang's structured outputs on ``/generate`` against the shared server
and the built-in random model: ``sampling_params.json_schema`` (the schema as a JSON
string, as SGLang takes it), ``regex`` and ``ebnf`` make every answer one the constraint
allows, streamed or not, and a stream spells what the same seeded request answers whole;
two at once, or an invalid one, get a 400 naming the field (with the engine's reason), and
the server goes on serving.

Only the constraint makes a random model's answers parse. The answers are bounded
(patterns, enums, maxItems, integer ranges), and whitespace-only tokens are biased away
(``logit_bias`` -100: a random model would fill every gap between JSON tokens with as much
whitespace as the grammar allows), so each ends well within ``max_new_tokens``; a bias
cannot bring back a token the grammar forbids, since the mask comes first.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import pytest

from pipeline.tokenizer_loader import load_tokenizer

TOKENIZER = load_tokenizer(None)
EOS = 0  # the built-in model's
MAX_NEW = 400
SEEDS = (3, 4, 5)
WHITESPACE = {
    str(i): -100.0
    for i in range(TOKENIZER.vocab_size)
    if i not in TOKENIZER.special_token_ids
    and (text := TOKENIZER.tokenizer.decode([i]))
    and not text.strip()
}

COLORS = ("red", "green", "blue")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "colors": {"type": "array", "items": {"enum": list(COLORS)}, "maxItems": 3},
        "size": {
            "type": "object",
            "properties": {
                "w": {"type": "integer", "minimum": 1, "maximum": 500},
                "big": {"type": "boolean"},
            },
            "required": ["w", "big"],
        },
    },
    "required": ["name", "colors", "size"],
}
REGEX = r"[A-Z][a-z]{2,5} [0-9]{1,3}"
EBNF = 'root ::= pair (", " pair)?\npair ::= key "=" [0-9]\nkey ::= "alpha" | "beta"'
EBNF_AS_REGEX = r"(alpha|beta)=[0-9](, (alpha|beta)=[0-9])?"


def follows_schema(value: object) -> bool:
    if not isinstance(value, dict) or set(value) != {"name", "colors", "size"}:
        return False
    name, colors, size = value["name"], value["colors"], value["size"]
    return (
        isinstance(name, str)
        and re.fullmatch("[a-z]{1,8}", name) is not None
        and isinstance(colors, list)
        and len(colors) <= 3
        and all(c in COLORS for c in colors)
        and isinstance(size, dict)
        and set(size) == {"w", "big"}
        and type(size["w"]) is int
        and 1 <= size["w"] <= 500
        and type(size["big"]) is bool
    )


KINDS: dict[str, tuple[dict[str, str], Any]] = {
    "json_schema": (
        {"json_schema": json.dumps(SCHEMA)},
        lambda text: follows_schema(json.loads(text)),
    ),
    "regex": ({"regex": REGEX}, lambda text: re.fullmatch(REGEX, text) is not None),
    "ebnf": ({"ebnf": EBNF}, lambda text: re.fullmatch(EBNF_AS_REGEX, text) is not None),
}


def _params(fields: dict[str, str], seed: int) -> dict[str, Any]:
    return {
        "max_new_tokens": MAX_NEW,
        "temperature": 1.0,
        "seed": seed,
        "logit_bias": WHITESPACE,
        **fields,
    }


def _streamed(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    """The last event of a /generate stream: SGLang's events each hold the output so far."""
    last: dict[str, Any] | None = None
    with http.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[len("data: ") :])
    assert last is not None, "the stream held no event"
    return last


@pytest.mark.parametrize("kind", list(KINDS))
def test_generate_answers_follow_each_sglang_constraint_streamed_or_not(
    http: httpx.Client, kind: str
) -> None:
    fields, valid = KINDS[kind]
    texts = set()
    for seed in SEEDS:
        body = {"text": "Once upon a time", "sampling_params": _params(fields, seed)}
        whole = http.post("/generate", json=body)
        assert whole.status_code == 200, whole.text
        answer = whole.json()
        assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}, answer
        assert valid(answer["text"]), answer["text"]
        streamed = _streamed(http, body)
        assert streamed["text"] == answer["text"] and streamed["output_ids"] == answer["output_ids"]
        assert streamed["meta_info"]["finish_reason"] == answer["meta_info"]["finish_reason"]
        texts.add(answer["text"])
    assert len(texts) > 1, "every seed drew one answer: the test shows nothing"


def _error(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


def test_two_constraints_at_once_are_refused_naming_the_second(http: httpx.Client) -> None:
    params = {"max_new_tokens": 4, "regex": REGEX, "ebnf": EBNF}
    error = _error(http.post("/generate", json={"text": "hi", "sampling_params": params}))
    assert (
        error["param"] == "sampling_params.ebnf"
        and "sampling_params.regex already gives one" in error["message"]
    ), error


INVALID = [
    pytest.param(
        {"json_schema": '{"type": "nonsense"}'},
        "sampling_params.json_schema",
        "nonsense",
        id="schema-engine",
    ),
    pytest.param(
        {"json_schema": "{not json"},
        "sampling_params.json_schema",
        "not valid JSON",
        id="schema-text",
    ),
    pytest.param(
        {"json_schema": {"type": "object"}},
        "sampling_params.json_schema",
        "Expected `str",
        id="schema-not-a-string",
    ),
    pytest.param({"regex": "(ab"}, "sampling_params.regex", "parenthesis", id="regex"),
    pytest.param(
        {"ebnf": "root ::= missing_rule"}, "sampling_params.ebnf", "missing_rule", id="ebnf"
    ),
]


@pytest.mark.parametrize(("fields", "param", "reason"), INVALID)
def test_an_invalid_constraint_is_a_400_naming_the_field_and_the_server_keeps_serving(
    http: httpx.Client, fields: dict[str, Any], param: str, reason: str
) -> None:
    for stream in (False, True):
        body = {"text": "hi", "stream": stream, "sampling_params": {"max_new_tokens": 8, **fields}}
        error = _error(http.post("/generate", json=body))
        assert error["param"] == param and reason in error["message"], error
    served = http.post(
        "/generate", json={"text": "hi", "sampling_params": _params({"regex": REGEX}, 1)}
    )
    assert served.status_code == 200 and re.fullmatch(REGEX, served.json()["text"]), served.text


# --- constrained neighbours leave the others' tokens alone ------------------------------------

UNCONSTRAINED_STREAMS = 200
CONSTRAINED_STREAMS = 56
NEIGHBOUR_TOKENS = 24


def _neighbour_body(i: int, fields: dict[str, str] | None) -> dict[str, Any]:
    """Stream ``i``: a prompt of its own, seeded sampling at temperature 1; unconstrained ones
    run ``NEIGHBOUR_TOKENS`` tokens (ignore_eos), constrained ones until their grammar ends."""
    prompt = TOKENIZER.encode(f"Stream number {i} says")
    if fields is None:
        params: dict[str, Any] = {
            "max_new_tokens": NEIGHBOUR_TOKENS,
            "temperature": 1.0,
            "seed": 7000 + i,
            "ignore_eos": True,
        }
    else:
        params = _params(fields, 9000 + i)
    return {"input_ids": prompt, "sampling_params": params, "stream": True}


async def _run_streams(base_url: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """All ``bodies`` at once as streams; each one's last event (it holds the whole output)."""

    async def one(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
        last: dict[str, Any] | None = None
        async with client.stream("POST", "/generate", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    last = json.loads(line[len("data: ") :])
        assert last is not None, "the stream held no event"
        return last

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=300.0, limits=limits) as client:
        return list(await asyncio.gather(*(one(client, body) for body in bodies)))


def test_constrained_neighbours_leave_200_seeded_streams_tokens_as_they_were_alone(
    http: httpx.Client,
) -> None:
    """200 seeded streams run alone, then again beside 56 constrained ones (all three kinds,
    all at once in one batch): every unconstrained stream draws the same tokens, since the mask
    touches only the constrained rows and a seeded draw depends on (seed, position) alone, and
    every constrained answer is one its constraint allows."""
    base_url = str(http.base_url)
    plain = [_neighbour_body(i, None) for i in range(UNCONSTRAINED_STREAMS)]
    kinds = list(KINDS)
    constrained = [
        (kinds[i % len(kinds)], _neighbour_body(i, KINDS[kinds[i % len(kinds)]][0]))
        for i in range(CONSTRAINED_STREAMS)
    ]

    # Each run starts from an empty prefix cache: a prompt found in the cache is not
    # recomputed, and its last position's logits computed alone differ from those of a whole
    # prefill in the last bits, which can flip a sampled token where two are near a tie.
    assert http.post("/flush_cache").status_code == 200
    alone = asyncio.run(_run_streams(base_url, plain))
    assert http.post("/flush_cache").status_code == 200
    together = asyncio.run(_run_streams(base_url, [*plain, *(body for _, body in constrained)]))

    for i, (before, after) in enumerate(zip(alone, together[:UNCONSTRAINED_STREAMS], strict=True)):
        assert len(before["output_ids"]) == NEIGHBOUR_TOKENS, before["meta_info"]
        assert after["output_ids"] == before["output_ids"], (
            f"stream {i} drew other tokens beside constrained neighbours"
        )
    for (kind, _), answer in zip(constrained, together[UNCONSTRAINED_STREAMS:], strict=True):
        assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}, answer[
            "meta_info"
        ]
        assert KINDS[kind][1](answer["text"]), (kind, answer["text"])
    assert len({json.dumps(b["output_ids"]) for b in alone}) == UNCONSTRAINED_STREAMS, (
        "streams should differ"
    )
