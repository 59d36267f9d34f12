"""Where vLLM and OpenAI agree and tokenpipe used to differ: chat templates that use the
tokenizer's special tokens, the ``developer`` role, tool-call history, ``logprobs: false``,
the completions default near the context, ``max_model_len`` on model cards, ``/tokenize`` and
``/detokenize``, and ``stop_reason``. Against real servers: the shared default one and a
small Llama-style model directory built here."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import tokenizers
from tokenizers.processors import TemplateProcessing

from pipeline.model_config import ModelConfig
from pipeline.tokenizer_loader import DEFAULT_TOKENIZER_DIR, load_tokenizer
from scheduler_proc.model.llama import LlamaForCausalLM
from tests.server_harness import ServerProcess
from tokenizer_proc.request_edge.body import decode_body
from tokenizer_proc.chat_template import ChatTemplate
from tokenizer_proc.openai.schema import ChatCompletionRequest

TOKENIZER = load_tokenizer(None)
MODEL = "tokenpipe-tiny"
PROMPT = "The quick brown fox jumps over the lazy dog, and then"
GREEDY: dict[str, Any] = {"temperature": 0}
IGNORE_EOS: dict[str, Any] = {"extra_body": {"ignore_eos": True}}

# Meta's Llama-2-chat template, verbatim: it opens each user turn with {{ bos_token }} and
# closes each assistant turn with {{ eos_token }}.
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') "
    "}}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% "
    "endif %}{% endfor %}"
)
LLAMA_MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Again"},
]
LLAMA_RENDERED = (
    "<s>[INST] <<SYS>>\nYou are terse.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] Again [/INST]"
)
LLAMA_CONTEXT = 128


def chatml(*turns: tuple[str, str], generation_prompt: bool = True) -> str:
    """The shipped template's rendering, by hand."""
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


def write_llama_dir(directory: Path) -> Path:
    """The shipped tokenizer plus ``<s>``/``</s>`` and a BOS post-processor (as Llama's fast
    tokenizer has), bos_token in tokenizer_config.json as an AddedToken dict and eos_token as
    a string, and a tiny random model with a 128-token context."""
    tok = tokenizers.Tokenizer.from_file(str(DEFAULT_TOKENIZER_DIR / "tokenizer.json"))
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    tok.save(str(directory / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    # As Llama-2-chat's tokenizer_config.json writes it.
    bos = {
        "__type": "AddedToken",
        "content": "<s>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
    }
    config = {
        "bos_token": bos,
        "eos_token": "</s>",
        "unk_token": None,
        "chat_template": LLAMA2_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    # Every id ends a sequence, so an unforced request always stops on EOS at its first token.
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": list(range(vocab))})
    )
    shape = ModelConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=LLAMA_CONTEXT,
    )
    LlamaForCausalLM.random(shape, seed=3, device="cpu").save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_dir(tmp_path_factory.mktemp("llama-style"))


@pytest.fixture(scope="module")
def llama_server(
    llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        tmp_path_factory.mktemp("llama-server") / "tmp", ["--model-path", str(llama_dir)]
    ).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def llama_oai(llama_server: ServerProcess) -> Iterator[openai.OpenAI]:
    with llama_server.openai_client() as c:
        yield c


def assert_error(resp: httpx.Response, status: int, needle: str) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == status and needle in error["message"], error


# --- (11) the tokenizer's special tokens in chat templates ----------------------------------


def test_llama_template_renders_bos_and_eos_tokens(
    llama_dir: Path, llama_server: ServerProcess, llama_oai: openai.OpenAI
) -> None:
    loaded = load_tokenizer(llama_dir)
    expected_ids = loaded.encode(LLAMA_RENDERED)
    assert expected_ids[0] == loaded.tokenizer.token_to_id("<s>")
    # What a chat request really runs.
    model = llama_oai.models.list().data[0].id
    out = llama_oai.chat.completions.create(
        model=model,
        messages=LLAMA_MESSAGES,  # type: ignore[arg-type]
        max_tokens=1,
    )
    assert out.usage is not None and out.usage.prompt_tokens == len(expected_ids)
    with llama_server.client() as c:
        tokenized = c.post("/tokenize", json={"messages": LLAMA_MESSAGES}).json()
    assert tokenized["tokens"] == expected_ids
    assert loaded.special_tokens == {
        "bos_token": "<s>",
        "eos_token": "</s>",
    }  # a dict and a string; null left out
    assert ChatTemplate.for_tokenizer(loaded).render(LLAMA_MESSAGES) == LLAMA_RENDERED


def test_llama_template_matches_transformers(llama_dir: Path) -> None:
    if importlib.util.find_spec("transformers") is None:
        message = "transformers is not installed (make test installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(message + "; CI=true: a missing reference is a failure")
        pytest.skip(message)
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast.from_pretrained(str(llama_dir))
    expected = reference.apply_chat_template(LLAMA_MESSAGES, tokenize=False)
    assert expected == LLAMA_RENDERED
    assert ChatTemplate.for_tokenizer(load_tokenizer(llama_dir)).render(LLAMA_MESSAGES) == expected


# --- (12a-c) chat messages and logprobs ----------------------------------------------------


def test_developer_message_acts_as_system(oai: openai.OpenAI, http: httpx.Client) -> None:
    as_developer: Any = [
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
    ]
    out = oai.chat.completions.create(model=MODEL, messages=as_developer, max_tokens=1)
    rendered = chatml(("system", "Be terse."), ("user", "Hi"))
    assert out.usage is not None and out.usage.prompt_tokens == len(TOKENIZER.encode(rendered))
    as_system = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    assert (
        http.post("/tokenize", json={"messages": as_developer}).json()
        == http.post("/tokenize", json={"messages": as_system}).json()
    )


def test_tool_call_history_is_accepted_and_rendered(oai: openai.OpenAI) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
    }
    messages: Any = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    out = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    # The built-in template writes an earlier call as a Hermes <tool_call> block.
    block = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    rendered = chatml(("user", "Weather?"), ("assistant", block), ("tool", "sunny"))
    assert out.usage is not None and out.usage.prompt_tokens == len(TOKENIZER.encode(rendered))
    # Templates that render tool calls get the arguments as an object, as vLLM hands them over.
    body: ChatCompletionRequest = decode_body(
        json.dumps({"messages": messages}).encode(), ChatCompletionRequest
    )  # type: ignore[assignment]
    assistant, tool = body.template_messages()[1:]
    assert assistant["content"] == "" and assistant["tool_calls"][0]["function"] == {
        "name": "weather",
        "arguments": {"city": "Oslo"},
    }
    assert tool == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize(
    "message,needle",
    [
        ({"role": "tool", "content": "sunny"}, "messages[0].tool_call_id"),
        ({"role": "user", "content": "x", "tool_calls": []}, "messages[0].tool_calls"),
        (
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}
                ],
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]},
            "arguments",
        ),
        ({"role": "user", "content": None}, "messages[0].content"),
    ],
    ids=[
        "tool without id",
        "tool_calls on user",
        "arguments not json",
        "arguments missing",
        "user content null",
    ],
)
def test_bad_tool_messages_name_the_field(
    http: httpx.Client, message: dict[str, Any], needle: str
) -> None:
    assert_error(
        http.post("/v1/chat/completions", json={"messages": [message], "max_tokens": 1}),
        400,
        needle,
    )


def test_logprobs_false_and_top_logprobs_zero_are_served(oai: openai.OpenAI) -> None:
    user: Any = [{"role": "user", "content": "hi"}]
    out = oai.chat.completions.create(
        model=MODEL, messages=user, max_tokens=2, logprobs=False, top_logprobs=0
    )
    assert out.choices[0].finish_reason in ("stop", "length") and out.choices[0].logprobs is None
    served = oai.chat.completions.create(model=MODEL, messages=user, max_tokens=2, logprobs=True)
    assert served.choices[0].logprobs is not None and served.choices[0].logprobs.content is not None
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        oai.chat.completions.create(model=MODEL, messages=user, max_tokens=2, top_logprobs=2)


# --- (12d) the completions default near the context -----------------------------------------


def test_completion_default_max_tokens_is_cut_at_the_context(llama_oai: openai.OpenAI) -> None:
    model = llama_oai.models.list().data[0].id
    roomy = llama_oai.completions.create(model=model, prompt=[7] * 10, **IGNORE_EOS)
    assert (
        roomy.choices[0].finish_reason == "length"
        and roomy.usage is not None
        and roomy.usage.completion_tokens == 16
    )
    near = llama_oai.completions.create(model=model, prompt=[7] * (LLAMA_CONTEXT - 5), **IGNORE_EOS)
    assert (
        near.choices[0].finish_reason == "length"
        and near.usage is not None
        and near.usage.completion_tokens == 5
    )
    # Each prompt of a batch gets its own room.
    batch = llama_oai.completions.create(
        model=model, prompt=[[7] * 10, [7] * (LLAMA_CONTEXT - 3)], **IGNORE_EOS
    )
    assert batch.usage is not None and batch.usage.completion_tokens == 16 + 3
    with pytest.raises(openai.BadRequestError, match="prompt"):
        llama_oai.completions.create(model=model, prompt=[7] * LLAMA_CONTEXT, **IGNORE_EOS)
    with pytest.raises(
        openai.BadRequestError, match="max_tokens"
    ):  # an explicit max_tokens is still checked
        llama_oai.completions.create(
            model=model, prompt=[7] * (LLAMA_CONTEXT - 5), max_tokens=6, **IGNORE_EOS
        )


# --- (12e) model cards ----------------------------------------------------------------------


def test_model_cards_carry_max_model_len(
    oai: openai.OpenAI, http: httpx.Client, llama_oai: openai.OpenAI
) -> None:
    context = http.get("/server_info").json()["context_length"]
    assert oai.models.list().data[0].max_model_len == context  # type: ignore[attr-defined]
    assert oai.models.retrieve(MODEL).max_model_len == context  # type: ignore[attr-defined]
    assert (
        llama_oai.models.list().data[0].max_model_len  # type: ignore[attr-defined]
        == LLAMA_CONTEXT
    )


# --- (12f) /tokenize and /detokenize ----------------------------------------------------------


def test_tokenize_prompt_and_messages(http: httpx.Client) -> None:
    context = http.get("/server_info").json()["context_length"]
    ids = TOKENIZER.encode(PROMPT)
    out = http.post("/tokenize", json={"prompt": PROMPT, "model": MODEL}).json()
    assert out == {"count": len(ids), "max_model_len": context, "tokens": ids, "token_strs": None}
    with_strs = http.post(
        "/tokenize", json={"prompt": "hi there", "return_token_strs": True}
    ).json()
    assert "".join(with_strs["token_strs"]).replace("Ġ", " ") == "hi there"
    assert http.post("/tokenize", json={"prompt": ""}).json()["count"] == 0
    messages = [{"role": "user", "content": "Hi"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == TOKENIZER.encode(chatml(("user", "Hi")))
    bare = http.post(
        "/tokenize", json={"messages": messages, "add_generation_prompt": False}
    ).json()
    assert bare["tokens"] == TOKENIZER.encode(chatml(("user", "Hi"), generation_prompt=False))


def test_tokenize_add_special_tokens(llama_server: ServerProcess, llama_dir: Path) -> None:
    loaded = load_tokenizer(llama_dir)
    bos = loaded.tokenizer.token_to_id("<s>")
    with llama_server.client() as c:
        plain = c.post("/tokenize", json={"prompt": "Hello"}).json()["tokens"]
        without = c.post("/tokenize", json={"prompt": "Hello", "add_special_tokens": False}).json()[
            "tokens"
        ]
        chat_with = c.post(
            "/tokenize",
            json={"messages": [{"role": "user", "content": "Hi"}], "add_special_tokens": True},
        )
    assert plain == [bos, *loaded.encode("Hello")] and without == loaded.encode("Hello")
    # The chat form defaults to false because the template already wrote the BOS: asked for, it
    # doubles.
    assert chat_with.json()["tokens"] == [bos, *loaded.encode("<s>[INST] Hi [/INST]")]


def test_detokenize_round_trips(http: httpx.Client) -> None:
    text = "<|im_start|>user\nnaïve café 🙂<|im_end|>"
    ids = TOKENIZER.encode(text)
    assert http.post("/detokenize", json={"tokens": ids, "model": MODEL}).json() == {
        "prompt": text,
        "text": text,
    }
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": "", "text": ""}


@pytest.mark.parametrize(
    "path,body,status,needle",
    [
        ("/tokenize", {}, 400, "prompt"),
        (
            "/tokenize",
            {"prompt": "a", "messages": [{"role": "user", "content": "a"}]},
            400,
            "prompt",
        ),
        ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, 400, "add_generation_prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": 7, "content": "a"}]}, 400, "role"),
        ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "gpt-4"),
        ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens[1]"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "gpt-4"}, 404, "gpt-4"),
    ],
)
def test_tokenize_bad_bodies_name_the_field(
    http: httpx.Client, path: str, body: dict[str, Any], status: int, needle: str
) -> None:
    assert_error(http.post(path, json=body), status, needle)


@pytest.mark.parametrize(
    "path,body,header",
    [
        ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus"),
        ("/detokenize", {"tokens": [1], "extra": True}, "extra"),
    ],
)
def test_tokenizer_routes_ignore_unknown_fields_and_name_them(
    http: httpx.Client, path: str, body: dict[str, Any], header: str
) -> None:
    resp = http.post(path, json=body)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-ignored-fields"] == header


def test_tokenize_renders_a_custom_role_as_given(http: httpx.Client) -> None:
    """As vLLM takes one: the template gets the role string as it is."""
    resp = http.post("/tokenize", json={"messages": [{"role": "robot", "content": "a"}]})
    assert resp.json()["tokens"] == TOKENIZER.encode(chatml(("robot", "a")))


# --- (12g) stop_reason ----------------------------------------------------------------------


def test_stop_reason_is_the_stop_string(oai: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=12, **GREEDY, **IGNORE_EOS)
    full = oai.completions.create(prompt=PROMPT, **kw).choices[0]
    assert full.finish_reason == "length" and full.stop_reason is None  # type: ignore[attr-defined]
    word = full.text.split()[2]
    stopped = oai.completions.create(
        prompt=PROMPT, stop=[word, "never-produced-zzz"], **kw
    ).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason == word  # type: ignore[attr-defined]

    messages: Any = [{"role": "user", "content": PROMPT}]
    chat = oai.chat.completions.create(messages=messages, **kw).choices[0]
    assert chat.stop_reason is None  # type: ignore[attr-defined]
    chat_word = (chat.message.content or "").split()[2]
    chat_stopped = oai.chat.completions.create(messages=messages, stop=chat_word, **kw).choices[0]
    assert chat_stopped.finish_reason == "stop"
    assert chat_stopped.stop_reason == chat_word  # type: ignore[attr-defined]

    # Streamed: null on every chunk but the finishing one, which names the stop string.
    for stream, stop in (
        (oai.completions.create(prompt=PROMPT, stop=[word], stream=True, **kw), word),
        (
            oai.chat.completions.create(messages=messages, stop=chat_word, stream=True, **kw),
            chat_word,
        ),
    ):
        choices = [chunk.choices[0] for chunk in stream if chunk.choices]
        assert [
            c.stop_reason  # type: ignore[attr-defined]
            for c in choices
        ] == [None] * (len(choices) - 1) + [stop]
        assert choices[-1].finish_reason == "stop"


def test_stop_reason_is_the_stop_token_id_and_null_for_eos(
    llama_dir: Path, llama_server: ServerProcess, llama_oai: openai.OpenAI
) -> None:
    # Every id is EOS on this model: the first token ends each request.
    with llama_server.client() as c:
        native = c.post(
            "/generate",
            json={"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
        ).json()
    [token] = native["output_ids"]
    model = llama_oai.models.list().data[0].id
    eos = llama_oai.completions.create(model=model, prompt="Hello", max_tokens=4, **GREEDY).choices[
        0
    ]
    assert eos.finish_reason == "stop" and eos.stop_reason is None  # type: ignore[attr-defined]
    named = llama_oai.completions.create(
        model=model, prompt="Hello", max_tokens=4, extra_body={"stop_token_ids": [token]}, **GREEDY
    ).choices[0]
    assert (
        named.finish_reason == "stop" and named.stop_reason == token  # type: ignore[attr-defined]
    )
    # Chat's first greedy token, from the same prompt through /generate, named as a stop token.
    messages: Any = [{"role": "user", "content": "Hi"}]
    with llama_server.client() as c:
        prompt = c.post("/tokenize", json={"messages": messages}).json()["tokens"]
        [first] = c.post(
            "/generate",
            json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
        ).json()["output_ids"]
    chat = llama_oai.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=4,
        extra_body={"stop_token_ids": [first]},
        **GREEDY,
    ).choices[0]
    assert chat.finish_reason == "stop" and chat.stop_reason == first  # type: ignore[attr-defined]


# --- text prompts get the tokenizer's BOS, as vLLM and SGLang encode them --------------------


@pytest.fixture(scope="module")
def llama_embedding_server(
    llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        tmp_path_factory.mktemp("llama-embed") / "tmp",
        ["--model-path", str(llama_dir), "--mode", "embedding"],
    )
    yield srv.wait_ready()
    srv.stop()


def test_a_text_prompt_gets_the_bos_on_every_route_that_adds_it(
    llama_dir: Path, llama_server: ServerProcess, llama_oai: openai.OpenAI
) -> None:
    """The post-processor's BOS leads a text prompt on /v1/completions (vLLM's default,
    ``add_special_tokens`` honoured either way) and /generate (SGLang's), so it is what the
    model runs and what usage counts; chat does not add one, as its template writes it."""
    loaded = load_tokenizer(llama_dir)
    bos, text_ids = loaded.tokenizer.token_to_id("<s>"), loaded.encode(PROMPT)
    model = llama_oai.models.list().data[0].id
    with llama_server.client() as c:
        assert c.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"] == [bos, *text_ids]

    completion = llama_oai.completions.create(model=model, prompt=PROMPT, max_tokens=1)
    assert completion.usage is not None and completion.usage.prompt_tokens == 1 + len(text_ids)
    bare = llama_oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=1, extra_body={"add_special_tokens": False}
    )
    assert bare.usage is not None and bare.usage.prompt_tokens == len(text_ids)
    # The echo is the request's own text: the BOS is the model's, not the client's.
    echoed = llama_oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=1, echo=True, **GREEDY
    )
    assert echoed.choices[0].text.startswith(PROMPT)

    with llama_server.client() as c:
        body = {
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": 1},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        meta = c.post("/generate", json=body).json()["meta_info"]
        lines = c.post("/generate", json={**body, "stream": True}).text.splitlines()
        streamed = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert meta["prompt_tokens"] == 1 + len(text_ids)
    assert [entry[1] for entry in meta["input_token_logprobs"]] == [bos, *text_ids]
    assert [entry[1] for entry in streamed[0]["meta_info"]["input_token_logprobs"]] == [
        bos,
        *text_ids,
    ]

    messages: Any = [{"role": "user", "content": "Hi"}]
    rendered_ids = loaded.encode("<s>[INST] Hi [/INST]")
    chat = llama_oai.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert (
        chat.usage is not None
        and chat.usage.prompt_tokens == len(rendered_ids)
        and rendered_ids.count(bos) == 1
    )
    # Asked for, as vLLM honours it, the post-processor's BOS comes in front of the template's.
    doubled = llama_oai.chat.completions.create(
        model=model, messages=messages, max_tokens=1, extra_body={"add_special_tokens": True}
    )
    assert doubled.usage is not None and doubled.usage.prompt_tokens == 1 + len(rendered_ids)


def test_an_embedding_text_input_gets_the_bos(
    llama_dir: Path, llama_embedding_server: ServerProcess
) -> None:
    """/v1/embeddings (vLLM's ``add_special_tokens``, true by default) and /encode (SGLang's)."""
    text_ids = load_tokenizer(llama_dir).encode(PROMPT)
    with llama_embedding_server.openai_client() as c:
        model = c.models.list().data[0].id
        assert c.embeddings.create(model=model, input=PROMPT).usage.prompt_tokens == 1 + len(
            text_ids
        )
        bare = c.embeddings.create(
            model=model, input=PROMPT, extra_body={"add_special_tokens": False}
        )
        assert bare.usage.prompt_tokens == len(text_ids)
    with llama_embedding_server.client() as h:
        assert h.post("/encode", json={"text": PROMPT}).json()["meta_info"][
            "prompt_tokens"
        ] == 1 + len(text_ids)


def test_without_a_post_processor_add_special_tokens_changes_nothing(
    oai: openai.OpenAI, http: httpx.Client
) -> None:
    """The shipped tokenizer has no post-processor: a text prompt is its text's ids, whatever
    the route or ``add_special_tokens`` say."""
    ids = TOKENIZER.encode(PROMPT)
    for add in (None, True, False):
        extra = {} if add is None else {"add_special_tokens": add}
        out = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body=extra)
        assert out.usage is not None and out.usage.prompt_tokens == len(ids), add
        assert http.post("/tokenize", json={"prompt": PROMPT, **extra}).json()["tokens"] == ids
    meta = http.post(
        "/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 1}}
    ).json()["meta_info"]
    assert meta["prompt_tokens"] == len(ids)
