"""Speculative decoding changes nothing but the speed (issue 42's proof): 200 prompts, greedy,
seeded (temperature 1.0, top_p 0.9) and seeded sharp (temperature 0.1, top_k 8, where
sampled rows accept drafts too), answer token for token as a plain server does, sent one at a
time, 16 at a time and in /generate batches of 128, with prompt lookup and a one-layer draft
model; so do stop strings and ids inside drafts, lengths that end mid-draft, min_new_tokens,
logprobs, n choices, streams, a JSON schema and a retraction. Each comparison also proves
drafts were verified and accepted. The target as its own draft accepts every draft, and
vLLM's counters agree with each other and with meta_info.

Every server serves one checkpoint (the built-in model's weights: its greedy text repeats,
so prompt lookup finds drafts) with deterministic inference on one thread, which makes a
verify pass's logits the same bits as a decode step's."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
from openai.types.chat import ChatCompletionMessageParam
from openai.types.shared_params import ResponseFormatJSONSchema

from pipeline.tokenizer_loader import load_tokenizer
from tests.server_harness import ServerProcess, wait_until
from tests.speculative_helpers import (
    ALWAYS,
    DETERMINISTIC,
    K,
    SpecCounts,
    draft_model_args,
    generate,
    ngram_args,
    retractions,
    spec_metrics,
    standalone_args,
    streamed_generate,
    total_counts,
    write_layer_draft,
    write_target,
)

TOKENIZER = load_tokenizer(None)
PROPOSERS = ("ngram", "standalone")
MODEL = "tiny"
COMMON = [
    *DETERMINISTIC,
    "--torch-threads",
    "1",
    "--metrics-compat",
    "vllm",
    "--served-model-name",
    MODEL,
]
WORDS = (
    "the cat sat on a mat while rain fell over old stone roofs and seven ships sailed "
    "from the harbour at dawn carrying salt iron wool and letters for the king who waited "
    "in his tower reading maps of rivers mountains forests towns"
).split()


def _prompt(rng: random.Random, i: int) -> str:
    """Varied lengths; half repeat their own text, so prompt lookup matches in the prompt."""
    kind = i % 4
    if kind == 0:
        return " ".join(rng.choices(WORDS, k=rng.randint(2, 8)))
    if kind == 1:
        return " ".join(rng.choices(WORDS, k=rng.randint(15, 40)))
    if kind == 2:
        phrase = " ".join(rng.choices(WORDS, k=rng.randint(3, 6)))
        return ". ".join([phrase] * rng.randint(2, 4)) + ". " + phrase.split()[0]
    start = rng.randint(0, 50)
    return "".join(f"x{j + 1} = x{j} + {j % 3}\n" for j in range(start, start + rng.randint(2, 5)))


def _sampling(mode: str, i: int) -> dict[str, Any]:
    length = {"max_new_tokens": 16 + (7 * i) % 25}  # 16 to 40
    if mode == "greedy":
        return {**length, "temperature": 0}
    if mode == "seeded":
        return {**length, "temperature": 1.0, "top_p": 0.9, "seed": 1000 + i}
    return {**length, "temperature": 0.1, "top_k": 8, "seed": 5000 + i}  # "sharp"


@dataclass(frozen=True)
class Case:
    prompt: str
    sampling: dict[str, Any]

    def body(self, **extra: Any) -> dict[str, Any]:
        return {"text": self.prompt, "sampling_params": self.sampling, **extra}


def _cases() -> list[Case]:
    rng = random.Random(42)
    prompts = [_prompt(rng, i) for i in range(200)]
    return [
        Case(p, _sampling(mode, i))
        for i, p in enumerate(prompts)
        for mode in ("greedy", "seeded" if i % 2 == 0 else "sharp")
    ]


CASES = _cases()


@dataclass
class Servers:
    plain: ServerProcess
    spec: dict[str, ServerProcess]  # each proposer's server, and "retract"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    root = tmp_path_factory.mktemp("speculative-exact")
    write_target(root / "target")
    write_layer_draft(root / "target", root / "draft")
    common = ["--model-path", str(root / "target"), *COMMON, "--max-total-tokens", "16384"]
    flags = {
        "plain": [],
        "ngram": [*ngram_args(), *ALWAYS],
        "standalone": [*standalone_args(root / "draft"), *ALWAYS],
        "self_draft": [*draft_model_args(root / "target"), *ALWAYS],
        # 24 requests of up to 70 tokens in a pool of 640: the running batch retracts.
        "retract": [*ngram_args(), *ALWAYS, "--max-total-tokens", "640"],
    }
    started = {
        name: ServerProcess(root / name / "tmp", [*common, *args]) for name, args in flags.items()
    }
    try:
        for server in started.values():
            server.wait_ready()
        yield Servers(started["plain"], {k: v for k, v in started.items() if k != "plain"})
    finally:
        with ThreadPoolExecutor(len(started)) as pool:
            list(pool.map(ServerProcess.stop, started.values()))


def answer_batch(server: ServerProcess, cases: list[Case], batch: int, **extra: Any) -> list[Any]:
    """Each case's /generate answer: one request at a time (batch 1), ``batch`` requests in
    flight at once (16), or /generate batches of ``batch`` prompts (128)."""
    with server.client() as client:
        if batch == 1:
            return [generate(client, case.body(**extra)) for case in cases]
        if batch <= 16:
            with ThreadPoolExecutor(batch) as pool:
                return list(pool.map(lambda c: generate(client, c.body(**extra)), cases))
        answers: list[Any] = []
        for start in range(0, len(cases), batch):
            part = cases[start : start + batch]
            body = {
                "text": [c.prompt for c in part],
                "sampling_params": [c.sampling for c in part],
                **extra,
            }
            answers.extend(generate(client, body))
        return answers


@pytest.fixture(scope="module")
def reference(servers: Servers) -> list[dict[str, Any]]:
    """The plain server's answer to every case (deterministic inference: the same tokens
    in any batch, so one batch of them stands for each alone)."""
    return answer_batch(servers.plain, CASES, 256)


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def mismatches(cases: list[Any], got: list[Any], want: list[Any]) -> list[str]:
    """A report of each case whose answer differs from plain decoding's: the request, both
    outputs and the first index where the tokens part."""
    found = []
    for case, g, w in zip(cases, got, want, strict=True):
        keys = ("text", "output_ids")
        same = all(g[k] == w[k] for k in keys)
        same = same and g["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"]
        if not same:
            at = first_difference(g["output_ids"], w["output_ids"])
            found.append(
                f"{case!r}\n  speculative: {g['output_ids']} {g['text']!r} "
                f"{g['meta_info']['finish_reason']}\n  plain:       {w['output_ids']} "
                f"{w['text']!r} {w['meta_info']['finish_reason']}\n  first differing index {at}"
            )
    return found


def assert_same(cases: list[Any], got: list[Any], want: list[Any]) -> None:
    found = mismatches(cases, got, want)
    assert not found, f"{len(found)} of {len(cases)} differ; the first:\n" + "\n".join(found[:3])


def assert_speculated(answers: list[Any], *, accepted: bool = True) -> SpecCounts:
    """The drafts were verified (and some accepted): else equal outputs prove nothing."""
    counts = total_counts([a["meta_info"] for a in answers])
    assert counts.verify_ct > 0 and counts.draft_tokens > 0, counts
    if accepted:
        assert counts.accepted_tokens > 0, counts
    return counts


def _batch_cases(batch: int) -> list[int]:
    """The cases sent at each batch size: all 400 in /generate batches of 128; at 16 in
    flight, one case of each prompt (greedy or sampled, picked by a seeded draw); one at a
    time, both cases of every 9th prompt."""
    if batch == 128:
        return list(range(len(CASES)))
    if batch == 16:
        rng = random.Random(16)
        return [2 * p + rng.randint(0, 1) for p in range(len(CASES) // 2)]
    return [i for p in range(0, len(CASES) // 2, 9) for i in (2 * p, 2 * p + 1)]


@pytest.mark.parametrize("batch", [1, 16, 128])
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_outputs_equal_plain_decoding(
    servers: Servers, reference: list[Any], proposer: str, batch: int
) -> None:
    """Greedy, seeded and sharp seeded answers to the 200 prompts are plain decoding's,
    token for token; drafts were verified in each mode and accepted in greedy and sharp
    rows (temperature 1.0 over this model's flat distribution rarely draws a draft)."""
    picked = _batch_cases(batch)
    cases = [CASES[i] for i in picked]
    got = answer_batch(servers.spec[proposer], cases, batch)
    assert_same(cases, got, [reference[i] for i in picked])
    for mode in ("greedy", "seeded", "sharp"):
        assert_speculated(
            [a for c, a in zip(cases, got) if _mode(c) == mode], accepted=mode != "seeded"
        )


def _mode(case: Case) -> str:
    s = case.sampling
    return "greedy" if s["temperature"] == 0 else "seeded" if "top_p" in s else "sharp"


def token_pieces(ids: list[int]) -> list[str]:
    """The text each token adds to the decode of those before it."""
    pieces, before = [], ""
    for k in range(1, len(ids) + 1):
        now = TOKENIZER.decode(ids[:k])
        pieces.append(now[len(before) :])
        before = now
    return pieces


def lifecycle_cases(reference: list[Any]) -> list[Case]:
    """Greedy and sharp cases whose output ends inside the span speculation covers: a stop
    string and a stop id met in the middle (the text of a token that was not met before),
    lengths of 1 to 7 (ends mid-draft when k is 4), and min_new_tokens past an early stop
    id (the stop id met again later ends it)."""
    made = []
    for i in range(0, len(CASES), 11):
        case, answer = CASES[i], reference[i]
        if _mode(case) == "seeded":
            continue
        ids, text = answer["output_ids"], answer["text"]
        pieces = token_pieces(ids)
        k = next(
            (
                j
                for j in range(len(ids) // 2, len(ids))
                if pieces[j].strip() and pieces[j] not in text[: len("".join(pieces[:j]))]
            ),
            None,
        )
        if k is not None:
            made.append(Case(case.prompt, {**case.sampling, "stop": [pieces[k]]}))
        made.append(Case(case.prompt, {**case.sampling, "stop_token_ids": [ids[len(ids) // 2]]}))
        made.append(Case(case.prompt, {**case.sampling, "max_new_tokens": 1 + i % 7}))
        early = {"stop_token_ids": [ids[1]], "min_new_tokens": 6}
        made.append(Case(case.prompt, {**case.sampling, **early}))
    return made


@pytest.mark.parametrize("proposer", ["ngram", "standalone"])
def test_stops_lengths_and_min_new_tokens_end_where_plain_decoding_does(
    servers: Servers, reference: list[Any], proposer: str
) -> None:
    cases = lifecycle_cases(reference)
    want = answer_batch(servers.plain, cases, 128)
    got = answer_batch(servers.spec[proposer], cases, 16)
    assert_same(cases, got, want)
    assert_speculated(got)
    reasons = [w["meta_info"]["finish_reason"]["type"] for w in want]
    assert reasons.count("stop") >= 20 and reasons.count("length") >= 20, reasons


@pytest.mark.parametrize("proposer", ["ngram", "standalone"])
def test_logprobs_of_accepted_tokens_equal_plain_decodings(
    servers: Servers, reference: list[Any], proposer: str
) -> None:
    """Each output token's logprob and its top 5, the same bits (the verify pass's logits
    are a decode step's)."""
    cases = CASES[::8] + CASES[3::16] + CASES[1::32]  # greedy, sharp, seeded
    extra = {"return_logprob": True, "top_logprobs_num": 5}
    want = answer_batch(servers.plain, cases, 128, **extra)
    got = answer_batch(servers.spec[proposer], cases, 16, **extra)
    assert_same(cases, got, want)
    assert_speculated(got)
    for case, g, w in zip(cases, got, want):
        for key in ("output_token_logprobs", "output_top_logprobs"):
            rows_g, rows_w = g["meta_info"][key], w["meta_info"][key]
            flat_g = [e for row in rows_g for e in (row if key.endswith("top_logprobs") else [row])]
            flat_w = [e for row in rows_w for e in (row if key.endswith("top_logprobs") else [row])]
            assert [e[1] for e in flat_g] == [e[1] for e in flat_w], (case, key)
            differ = [(a[0], b[0]) for a, b in zip(flat_g, flat_w) if a[0] != b[0]]
            assert not differ, (case, key, differ[:5])


@pytest.mark.parametrize("proposer", ["ngram", "standalone"])
def test_streams_assemble_to_plain_decodings_answer(
    servers: Servers, reference: list[Any], proposer: str
) -> None:
    """Streamed answers, 8 at a time, assemble to plain decoding's, each event extending
    the one before: 12 greedy or sharp cases whose answer loops (a token 4 times or more,
    where drafts are accepted and an event carries several tokens) and 4 seeded ones."""
    looping = [
        i
        for i, answer in enumerate(reference)
        if _mode(CASES[i]) != "seeded" and max(Counter(answer["output_ids"]).values()) >= 4
    ]
    picked = looping[::3][:12] + list(range(1, len(CASES), 100))
    with servers.spec[proposer].client() as client, ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: streamed_generate(client, CASES[i].body()), picked))
    assert_same([CASES[i] for i in picked], got, [reference[i] for i in picked])
    assert_speculated(got)


@pytest.mark.parametrize("proposer", ["ngram", "standalone"])
def test_n_choices_and_chat_streams_through_the_openai_client(
    servers: Servers, proposer: str
) -> None:
    """n = 3 seeded and sharp completions, and a streamed chat, equal the plain server's."""
    prompts = [CASES[2 * p].prompt for p in (2, 3, 5)]  # a repeated phrase, code, long text
    settings: list[dict[str, Any]] = [
        {"temperature": 1.0, "top_p": 0.9, "seed": 7},
        {"temperature": 0.1, "extra_body": {"top_k": 8}, "seed": 11},
    ]

    def choices(server: ServerProcess) -> list[list[str]]:
        client = server.openai_client()
        out = []
        for prompt in prompts:
            for s in settings:
                made = client.completions.create(
                    model=MODEL, prompt=prompt, n=3, max_tokens=32, **s
                )
                out.append([c.text for c in sorted(made.choices, key=lambda c: c.index)])
        return out

    def chat(server: ServerProcess, stream: bool) -> list[str]:
        client = server.openai_client()
        texts = []
        for prompt in prompts:
            messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": prompt}]
            if not stream:
                made = client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=32, temperature=0
                )
                texts.append(made.choices[0].message.content or "")
                continue
            events = client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=32, temperature=0, stream=True
            )
            texts.append("".join(e.choices[0].delta.content or "" for e in events if e.choices))
        return texts

    spec = servers.spec[proposer]
    with ThreadPoolExecutor(2) as pool:
        got, want = pool.map(choices, [spec, servers.plain])
        assert got == want
        got_chat, want_chat = pool.map(chat, [spec, servers.plain], [True, False])
        assert got_chat == want_chat


SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 1, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "n", "ok"],
    "additionalProperties": False,
}
# Examples in the prompt: prompt lookup drafts JSON, which the grammar must check.
JSON_PROMPT = 'Answer as JSON. {"color": "red", "n": 12, "ok": true} ' * 3
WHITESPACE = {
    str(i): -100
    for i in range(TOKENIZER.vocab_size)
    if i not in TOKENIZER.special_token_ids
    and (text := TOKENIZER.tokenizer.decode([i]))
    and not text.strip()
}


@pytest.mark.parametrize("proposer", ["ngram", "standalone"])
def test_a_json_schema_answer_equals_plain_decodings(servers: Servers, proposer: str) -> None:
    """SGLang's json_schema on /generate (greedy and seeded) and OpenAI's response_format
    in chat: the same answers, each valid JSON of the schema."""
    cases = [
        Case(
            JSON_PROMPT + f"Item {i}:",
            {"max_new_tokens": 64, "json_schema": json.dumps(SCHEMA), "logit_bias": WHITESPACE}
            | ({"temperature": 0} if i % 2 else {"temperature": 0.1, "top_k": 8, "seed": i}),
        )
        for i in range(8)
    ]
    want = answer_batch(servers.plain, cases, 16)
    got = answer_batch(servers.spec[proposer], cases, 16)
    assert_same(cases, got, want)
    assert_speculated(got, accepted=False)
    for answer in got:
        value = json.loads(answer["text"])
        assert set(value) == {"color", "n", "ok"}, answer["text"]
    response_format: ResponseFormatJSONSchema = {
        "type": "json_schema",
        "json_schema": {"name": "c", "schema": SCHEMA},
    }

    def chat(server: ServerProcess) -> str:
        made = server.openai_client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": JSON_PROMPT}],
            max_tokens=64,
            temperature=0,
            response_format=response_format,
            logit_bias=WHITESPACE,
        )
        return made.choices[0].message.content or ""

    text = chat(servers.spec[proposer])
    assert text == chat(servers.plain) and set(json.loads(text)) == {"color", "n", "ok"}


def test_a_retracted_speculative_batch_answers_as_plain_decoding(
    servers: Servers, reference: list[Any]
) -> None:
    """24 requests in a pool of 640 tokens: some are retracted (their KV given back and
    recomputed), and every answer is still plain decoding's."""
    picked = [i for i in range(0, len(CASES), 3) if len(CASES[i].prompt) < 120][:24]
    server = servers.spec["retract"]
    got = answer_batch(server, [CASES[i] for i in picked], 128)
    assert_same([CASES[i] for i in picked], got, [reference[i] for i in picked])
    assert_speculated(got)
    assert sum(a["meta_info"]["num_retractions"] for a in got) > 0
    with server.client() as client:  # /metrics has it after the next stats report
        assert wait_until(lambda: retractions(client) > 0, 30)


def test_a_draft_equal_to_the_target_accepts_every_draft(
    servers: Servers, reference: list[Any]
) -> None:
    """The target as its own draft, greedy, seeded and sharp: every draft is accepted (the
    same logits and the same randomness), per request, in the meta_info sums and in vLLM's
    counters, and the answers are plain decoding's. Cases that end at their length only: a
    stop drawn inside the drafts rejects the drafts after it."""
    picked = [
        i for i in range(60) if reference[i]["meta_info"]["finish_reason"]["type"] == "length"
    ]
    cases = [CASES[i] for i in picked]
    sums, delta, got = counted_run(servers.spec["self_draft"], cases)
    assert_same(cases, got, [reference[i] for i in picked])
    for case, answer in zip(cases, got):
        counts = SpecCounts.of(answer["meta_info"])
        assert counts.accepted_tokens == counts.draft_tokens, (case, counts)
    assert sums.accepted_tokens == sums.draft_tokens, sums
    assert delta[ACCEPTED] == delta[DRAFT_TOKENS], delta


@pytest.mark.parametrize("proposer", ["ngram", "standalone"])
def test_the_counters_agree_with_each_other_and_with_meta_info(
    servers: Servers, proposer: str
) -> None:
    cases = CASES[:40]
    sums, _, _ = counted_run(servers.spec[proposer], cases)
    assert 0 < sums.accepted_tokens < sums.draft_tokens, sums


DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"


def counted_run(
    server: ServerProcess, cases: list[Case]
) -> tuple[SpecCounts, dict[str, float], list[Any]]:
    """Answers ``cases`` 16 at a time and checks vLLM's counters over the run against the
    answers' meta_info sums (accepted and drafted tokens equal; drafts at most the verify
    passes) and each other (accepted per position sum to the accepted, no position accepts
    more than the one before it, at most k draft tokens a draft). Returns the sums, the
    counters' increase and the answers."""
    with server.client() as client:
        before = spec_metrics(client)
        got = answer_batch(server, cases, 16)
        sums = assert_speculated(got)
        # The counters reach /metrics with the scheduler's next stats report.
        assert wait_until(
            lambda: _delta(spec_metrics(client), before, DRAFT_TOKENS) >= sums.draft_tokens, 30
        ), (spec_metrics(client), before, sums)
        after = spec_metrics(client)
    delta = {key: _delta(after, before, key) for key in after}
    assert delta[ACCEPTED] == sums.accepted_tokens, (delta, sums)
    assert delta[DRAFT_TOKENS] == sums.draft_tokens, (delta, sums)
    per_pos = [delta.get(f"{ACCEPTED}_per_pos[{j}]", 0.0) for j in range(K)]
    assert sum(per_pos) == sums.accepted_tokens, (per_pos, sums)
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos
    drafts = delta["vllm:spec_decode_num_drafts"]
    assert 0 < drafts <= sums.verify_ct, (delta, sums)
    assert delta[DRAFT_TOKENS] <= K * drafts, delta
    return sums, delta, got


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)
