"""vLLM's extra request fields on the OpenAI routes, with vLLM's semantics and shapes, through
the official client (``extra_body``) on the shared server: ``prompt_logprobs``,
``return_tokens_as_token_ids``, ``return_token_ids``, chat's ``continue_final_message``,
``add_generation_prompt`` and ``echo``, ``truncate_prompt_tokens``; streamed where vLLM
streams them, and bad values refused by name (tokenizer_proc/openai/vllm_extras.py). The
values of prompt logprobs against transformers are in test_logprobs_e2e.py."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tokenizer_proc.chat_template import ChatTemplate

MODEL = "tokenpipe-tiny"
PROMPT = "The quick brown fox jumps over the lazy dog"
MESSAGES: list[Any] = [{"role": "user", "content": "Tell me a story"}]
PREFILL: list[Any] = [*MESSAGES, {"role": "assistant", "content": "Once upon a time"}]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 4}
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


def tokenize(http: httpx.Client, text: str) -> list[int]:
    ids: list[int] = http.post(
        "/tokenize", json={"prompt": text, "add_special_tokens": False}
    ).json()["tokens"]
    return ids


def extra(obj: Any, key: str) -> Any:
    """A field beyond OpenAI's schema, as the official client keeps it."""
    assert obj.model_extra is not None and key in obj.model_extra, f"{key} missing"
    return obj.model_extra[key]


def assert_prompt_logprobs(entries: list[Any], prompt_ids: list[int], top: int) -> None:
    """vLLM's shape: null first, then per position the prompt token's entry first and the
    ``top`` most likely after it, ranked 1 to ``top``; the prompt token's rank is always a
    number (its place among the top ones, or beyond them)."""
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for token, entry in zip(prompt_ids[1:], entries[1:]):
        keys = list(entry)
        assert keys[0] == str(token) and all(
            set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values()
        )
        mine = entry[str(token)]
        assert isinstance(mine["rank"], int) and mine["rank"] >= 1, entry
        ranked = sorted((v["rank"], k) for k, v in entry.items() if v["rank"] <= top)
        assert [r for r, _ in ranked] == list(range(1, top + 1)), entry
        values = [entry[k]["logprob"] for _, k in ranked]
        assert values == sorted(values, reverse=True)
        assert len(entry) == top + (mine["rank"] > top)
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())


# --- prompt_logprobs --------------------------------------------------------------------------


def test_prompt_logprobs_are_on_each_completion_choice(
    oai: openai.OpenAI, http: httpx.Client
) -> None:
    out = oai.completions.create(
        model=MODEL, prompt=PROMPT, n=2, extra_body={"prompt_logprobs": 3}, **GREEDY
    )
    prompt_ids = tokenize(http, PROMPT)
    assert out.usage is not None and out.usage.prompt_tokens == len(prompt_ids)
    for choice in out.choices:
        assert_prompt_logprobs(extra(choice, "prompt_logprobs"), prompt_ids, 3)
        assert choice.logprobs is None  # output logprobs were not asked
    assert extra(out.choices[0], "prompt_logprobs") == extra(out.choices[1], "prompt_logprobs")
    raw = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0},
    ).json()
    assert "prompt_logprobs" in raw["choices"][0] and "prompt_logprobs" not in raw
    # The prompt token's entry alone, its rank still a number (the scheduler's rank column).
    assert_prompt_logprobs(raw["choices"][0]["prompt_logprobs"], prompt_ids, 0)


def test_prompt_logprobs_are_at_the_chat_responses_top_level(oai: openai.OpenAI) -> None:
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        extra_body={"prompt_logprobs": 2, "return_token_ids": True},
        logprobs=True,
        top_logprobs=1,
        **GREEDY,
    )
    prompt_ids = extra(chat, "prompt_token_ids")
    assert chat.usage is not None and chat.usage.prompt_tokens == len(prompt_ids)
    assert_prompt_logprobs(extra(chat, "prompt_logprobs"), prompt_ids, 2)
    assert "prompt_logprobs" not in (chat.choices[0].model_extra or {})
    # The output's top count is its own, though the scheduler computed 2 for the prompt.
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and all(len(e.top_logprobs) == 1 for e in content)


def test_prompt_logprobs_0_streams_and_more_are_refused_in_a_stream(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stream": True}
    with http.stream("POST", "/v1/completions", json={**body, "prompt_logprobs": 0}) as resp:
        assert resp.status_code == 200 and "prompt_logprobs" not in resp.read().decode()
    refused = http.post("/v1/completions", json={**body, "prompt_logprobs": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    assert "not available when stream=True" in refused.json()["error"]["message"]


@pytest.mark.parametrize("value", [-2, -1, 21, "3", 1.5, True])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_bad_prompt_logprobs_are_refused_by_name(
    http: httpx.Client, route: str, value: Any
) -> None:
    base = {"prompt": PROMPT} if route == "/v1/completions" else {"messages": MESSAGES}
    refused = http.post(
        route, json={"model": MODEL, **base, "max_tokens": 1, "prompt_logprobs": value}
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs", (
        refused.text
    )


# --- return_tokens_as_token_ids ------------------------------------------------------------------


def test_return_tokens_as_token_ids_names_completion_tokens_by_id(oai: openai.OpenAI) -> None:
    asked = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    out = oai.completions.create(model=MODEL, prompt=PROMPT, logprobs=2, extra_body=asked, **GREEDY)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens == [
        f"token_id:{t}" for t in extra(out.choices[0], "token_ids")
    ]
    assert all(
        all(k.startswith("token_id:") for k in top) and 2 <= len(top) <= 3
        for top in lp.top_logprobs or []
    )
    assert lp.text_offset == [
        sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))
    ]  # offsets of these strings, as vLLM's
    chunks = list(
        oai.completions.create(
            model=MODEL, prompt=PROMPT, logprobs=2, stream=True, extra_body=asked, **GREEDY
        )
    )
    assert [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens or []
    ] == lp.tokens


def test_return_tokens_as_token_ids_names_chat_tokens_by_id(oai: openai.OpenAI) -> None:
    asked = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    chat = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=2, extra_body=asked, **GREEDY
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and [e.token for e in content] == [
        f"token_id:{t}" for t in extra(chat.choices[0], "token_ids")
    ]
    assert all(
        len(e.top_logprobs) == 2 and all(t.token.startswith("token_id:") for t in e.top_logprobs)
        for e in content
    )
    # The bytes stay the token's own: together they still spell the answer.
    text = bytes(b for e in content for b in e.bytes or []).decode("utf-8", errors="replace")
    assert text.rstrip("\ufffd") == (chat.choices[0].message.content or "").rstrip("\ufffd")
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            extra_body=asked,
            **GREEDY,
        )
    )
    streamed = [
        e.token
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    assert streamed == [e.token for e in content]


# --- return_token_ids -----------------------------------------------------------------------------


def test_return_token_ids_on_completions_whole_and_streamed(
    oai: openai.OpenAI, http: httpx.Client
) -> None:
    prompt_ids = tokenize(http, PROMPT)
    out = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        extra_body={"return_token_ids": True, "ignore_eos": True},
        **GREEDY,
    )
    choice = out.choices[0]
    ids = extra(choice, "token_ids")
    assert extra(choice, "prompt_token_ids") == prompt_ids and len(ids) == 4
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == choice.text
    raw = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "return_token_ids": True, **GREEDY},
    ).json()["choices"][0]
    # vLLM's order
    assert list(raw)[-4:] == ["token_ids", "prompt_logprobs", "prompt_token_ids", "routed_experts"]
    streamed = oai.completions.create(
        model=MODEL,
        prompt=PROMPT,
        stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
        **GREEDY,
    )
    chunks = [c for c in streamed if c.choices]
    assert extra(chunks[0].choices[0], "prompt_token_ids") == prompt_ids
    assert all(extra(c.choices[0], "prompt_token_ids") is None for c in chunks[1:])
    assert [t for c in chunks for t in extra(c.choices[0], "token_ids")] == ids


def test_return_token_ids_on_chat_whole_and_streamed(oai: openai.OpenAI) -> None:
    asked = {"return_token_ids": True, "ignore_eos": True}
    chat = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, seed=3, extra_body=asked, **GREEDY
    )
    prompt_ids = extra(chat, "prompt_token_ids")
    assert chat.usage is not None and len(prompt_ids) == chat.usage.prompt_tokens
    assert all(len(extra(c, "token_ids")) == 4 for c in chat.choices)
    chunks = list(
        oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, stream=True, extra_body=asked, **GREEDY
        )
    )
    # vLLM puts the prompt's ids on the role chunk (the first), each chunk's own ids on its choice.
    assert (
        chunks[0].choices[0].delta.role == "assistant"
        and extra(chunks[0], "prompt_token_ids") == prompt_ids
    )
    assert all("prompt_token_ids" not in (c.model_extra or {}) for c in chunks[1:])  # role only
    single = oai.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=asked, **GREEDY)
    assert [t for c in chunks[1:] for t in extra(c.choices[0], "token_ids")] == extra(
        single.choices[0], "token_ids"
    )


# --- continue_final_message, add_generation_prompt, echo ----------------------------------------


def test_continue_final_message_leaves_the_last_message_open(
    oai: openai.OpenAI, http: httpx.Client
) -> None:
    chat = oai.chat.completions.create(
        model=MODEL, messages=PREFILL, extra_body={**CONTINUE, "return_token_ids": True}, **GREEDY
    )
    want = "<|im_start|>user\nTell me a story<|im_end|>\n<|im_start|>assistant\nOnce upon a time"
    assert (
        ChatTemplate(None).render(PREFILL, add_generation_prompt=False, continue_final_message=True)
        == want
    )
    assert extra(chat, "prompt_token_ids") == tokenize(http, want)
    assert chat.choices[0].message.role == "assistant"
    # The same prompt as a completion continues the same way.
    same = oai.completions.create(model=MODEL, prompt=tokenize(http, want), **GREEDY)
    assert chat.choices[0].message.content == same.choices[0].text


def test_without_a_generation_prompt_the_answer_takes_the_last_messages_role(
    oai: openai.OpenAI, http: httpx.Client
) -> None:
    asked = {"add_generation_prompt": False, "return_token_ids": True}
    chat = oai.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=asked, **GREEDY)
    assert chat.choices[0].message.role == "user"
    assert extra(chat, "prompt_token_ids") == tokenize(
        http, "<|im_start|>user\nTell me a story<|im_end|>\n"
    )
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            stream=True,
            extra_body={"add_generation_prompt": False},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "user"


def test_continue_final_message_with_a_generation_prompt_is_refused(http: httpx.Client) -> None:
    """Both sent true (vLLM checks the fields as sent: continue_final_message alone is no
    generation prompt, test_peer_errors_and_defaults.py)."""
    body = {"continue_final_message": True, "add_generation_prompt": True}
    refused = http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": PREFILL, "max_tokens": 1, **body}
    )
    error = refused.json()["error"]
    assert (
        refused.status_code == 400
        and error["param"] == "continue_final_message"
        and "add_generation_prompt" in error["message"]
    )


def test_continue_final_message_needs_text_the_template_shows() -> None:
    """A template that drops the last message's text cannot leave it open (transformers'
    error; the route answers it with a 400 naming continue_final_message)."""
    dropping = ChatTemplate("{% for m in messages %}{{ m['role'] }}{% endfor %}")
    with pytest.raises(ValueError, match="final message does not appear"):
        dropping.render(PREFILL, add_generation_prompt=False, continue_final_message=True)


def test_chat_echo_leads_with_the_last_message_when_its_role_is_the_answers(
    oai: openai.OpenAI,
) -> None:
    asked = {**CONTINUE, "echo": True, "ignore_eos": True}
    plain = oai.chat.completions.create(
        model=MODEL, messages=PREFILL, extra_body={**CONTINUE, "ignore_eos": True}, **GREEDY
    )
    chat = oai.chat.completions.create(model=MODEL, messages=PREFILL, extra_body=asked, **GREEDY)
    assert chat.choices[0].message.content == "Once upon a time" + (
        plain.choices[0].message.content or ""
    )
    # vLLM: an echo without prompt_logprobs lists the prompt's with top_logprobs' count (0).
    entries = extra(chat, "prompt_logprobs")
    assert (
        chat.usage is not None
        and len(entries) == chat.usage.prompt_tokens
        and all(len(e) == 1 for e in entries[1:])
    )
    chunks = list(
        oai.chat.completions.create(
            model=MODEL, messages=PREFILL, stream=True, extra_body=asked, **GREEDY
        )
    )
    assert (
        chunks[0].choices[0].delta.role == "assistant"
        and chunks[1].choices[0].delta.content == "Once upon a time"
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == chat.choices[0].message.content
    )
    # The last message is the user's and the answer the assistant's: nothing to echo.
    other = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, extra_body={"echo": True, "ignore_eos": True}, **GREEDY
    )
    assert not (other.choices[0].message.content or "").startswith("Tell me a story")


# --- truncate_prompt_tokens -----------------------------------------------------------------------


def test_truncate_prompt_tokens_keeps_the_last_tokens(
    oai: openai.OpenAI, http: httpx.Client
) -> None:
    prompt_ids = tokenize(http, PROMPT)
    asked = {"truncate_prompt_tokens": 3, "return_token_ids": True}
    out = oai.completions.create(model=MODEL, prompt=PROMPT, extra_body=asked, **GREEDY)
    assert out.usage is not None and out.usage.prompt_tokens == 3
    assert extra(out.choices[0], "prompt_token_ids") == prompt_ids[-3:]
    same = oai.completions.create(model=MODEL, prompt=prompt_ids[-3:], **GREEDY)
    assert out.choices[0].text == same.choices[0].text
    right = oai.completions.create(
        model=MODEL, prompt=PROMPT, extra_body={**asked, "truncation_side": "right"}, **GREEDY
    )
    assert extra(right.choices[0], "prompt_token_ids") == prompt_ids[:3]
    whole = oai.completions.create(
        model=MODEL, prompt=PROMPT, extra_body={"truncate_prompt_tokens": -1}, **GREEDY
    )
    assert whole.usage is not None and whole.usage.prompt_tokens == len(prompt_ids)
    echoed = oai.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, extra_body={"truncate_prompt_tokens": 3}, **GREEDY
    )
    assert (
        echoed.choices[0].text
        == http.post("/detokenize", json={"tokens": prompt_ids[-3:]}).json()["prompt"]
        + same.choices[0].text
    )
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        extra_body={"truncate_prompt_tokens": 2, "return_token_ids": True},
        **GREEDY,
    )
    assert (
        chat.usage is not None
        and chat.usage.prompt_tokens == 2
        and len(extra(chat, "prompt_token_ids")) == 2
    )


@pytest.mark.parametrize("value", [0, -2, "3", 10**9])
def test_bad_truncate_prompt_tokens_are_refused_by_name(http: httpx.Client, value: Any) -> None:
    refused = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "truncate_prompt_tokens": value},
    )
    assert (
        refused.status_code == 400 and refused.json()["error"]["param"] == "truncate_prompt_tokens"
    ), refused.text


def test_bad_truncation_side_and_flags_are_refused_by_name(http: httpx.Client) -> None:
    for field, value in (
        ("truncation_side", "middle"),
        ("return_token_ids", 1),
        ("return_tokens_as_token_ids", "yes"),
    ):
        refused = http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1, field: value},
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, (
            refused.text
        )
    for field, value in (
        ("echo", 1),
        ("add_generation_prompt", "no"),
        ("continue_final_message", 0),
    ):
        refused = http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1, field: value},
        )
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field, (
            refused.text
        )
