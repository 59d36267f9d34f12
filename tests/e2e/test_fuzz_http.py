"""Bad HTTP input, generated: 10,000 hypothesis bodies across every POST endpoint (a generate
server and an embedding server), and GETs with junk query strings and paths. Each must get
a 4xx with an OpenAI-style error body or a well-formed answer: never a 5xx, never a hang, and
both servers are healthy at the end.

The bodies are JSON objects whose keys are the endpoint's real field names (plus a stray key
now and then) and whose values are plausible (often valid) or junk of any JSON type; some
bodies are top-level junk, truncated JSON, NaN literals or raw bytes. Bodies that happen to be
valid run for real, so a valid body's token budget is capped at 4 to keep the run short.

Hypothesis only generates here; WORKERS threads with their own httpx clients send the cases
and check the answers while it does (enough of them that the few slow valid requests do not
stall the rest), and failures are listed at the end, each case as it was sent: no shrinking,
which would resend many requests. TOKENPIPE_FUZZ_EXAMPLES changes the number of bodies.

Where the time goes (10,000 bodies, measured on 2 cores): about 33 CPU-seconds in this process
(hypothesis ~1.7 ms a body, httpx ~1.5 ms a request) and about 25 in the servers, most of it
the generate server's scheduler running the valid bodies. The wall time depends on what else
shares the cores."""

from __future__ import annotations

import base64
import io
import json
import os
import queue
import threading
import time
import wave
from collections import Counter
from collections.abc import Iterator
from typing import Any, NamedTuple
from urllib.parse import quote, quote_from_bytes

import httpx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from pipeline.tokenizer_loader import DEFAULT_MODEL_NAME
from tests.server_harness import ServerProcess

POST_EXAMPLES = int(os.environ.get("TOKENPIPE_FUZZ_EXAMPLES", "10000"))
BATCH = 8  # bodies per hypothesis example: its fixed cost (~2 ms) is per example
GET_EXAMPLES = 500
WORKERS = 8
REQUEST_TIMEOUT = 30.0  # a hang: no answer within this is a failure
TOKEN_CAP = 4
MAX_NEW_TOKENS_LIMIT = (
    4096  # the server's default --max-new-tokens-limit: above it, a 400 without generating
)
MISSING: Any = object()


class Case(NamedTuple):
    target: str  # "gen" or "emb"
    method: str
    path: str
    content: bytes | None
    content_type: str | None


# --- media samples: a few real tiny files, and broken ones ---------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(buf, "PNG")
    return buf.getvalue()


def _gif(frames: int) -> bytes:
    buf = io.BytesIO()
    images = [Image.new("P", (8, 8), i) for i in range(frames)]
    images[0].save(buf, "GIF", save_all=True, append_images=images[1:], duration=50)
    return buf.getvalue()


def _wav(nframes: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(b"\x00\x01" * nframes)
    return buf.getvalue()


_PNG, _GIF, _WAV = _png(3, 2), _gif(3), _wav(400)
MEDIA_ITEMS = [
    _b64(_PNG),
    "data:image/png;base64," + _b64(_PNG),
    _b64(_GIF),
    "data:image/gif;base64," + _b64(_GIF),
    _b64(_WAV),
    "data:audio/wav;base64," + _b64(_WAV),
    _b64(_PNG[:20]),  # truncated
    _b64(_WAV[:30]),
    _b64(b"GIF89a" + b"\x00" * 10),
    "data:image/png,notbase64",
    "data:;base64,",
    "http://127.0.0.1:1/x.png",
    "file:///etc/passwd",
    "=====",
    "QUJD",  # base64 of b"ABC"
    "",
]

# --- strategies ---------------------------------------------------------------------------------
# Hypothesis costs about 2 ms per example and 0.1 ms per draw here, so a body is built from few
# draws: each value is one pick from a pool of literals and strategies (a picked strategy is
# drawn from in turn), and one example holds BATCH bodies.


def pool(*entries: Any) -> st.SearchStrategy[Any]:
    """One pick among literals and strategies; a strategy picked is drawn from."""
    return st.sampled_from(entries)


junk_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),  # unbounded: integers past 64 bits too
    st.floats(allow_nan=True, allow_infinity=True),  # NaN and Infinity go out as bare literals
    st.text(max_size=12),
)
junk_tree = st.recursive(
    junk_scalar,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=5,
)
JUNK = pool(
    None, True, False, 0, -1, 1, 3.5, -0.0, 2**63, 2**64, -(2**63) - 1, 10**30,
    float("nan"), float("inf"), float("-inf"), 1e308, 5e-324,
    "", "0", "4", "true", "null", " ", "\x00", "\u202e", "\U0001f642" * 3, "x" * 300,
    [], [None], [1, "a"], [[]], [[1, [2, [3]]]], [0.5], ["a", ["b"]],
    {}, {"a": 1}, {"": None}, {"max_new_tokens": 4}, {"type": "text"}, {"text": "hi"},
    junk_scalar, junk_tree, st.text(max_size=16), st.integers(),
)  # fmt: skip

TEXT = pool(
    "", " ", "Hello", "Once upon a time", "<|im_start|>user", "<|endoftext|>", "\x00\x01",
    "日本語のテキスト", "\U0001f642", "a" * 200, st.text(max_size=16),
)  # fmt: skip
IDS = pool(
    [],
    [1],
    [1, 2, 3],
    [0],
    [4095],
    [4096],
    [-1],
    [2**63],
    [2**64],
    [10**30],
    [1, "2"],
    [1.0],
    st.lists(st.integers(0, 4095), max_size=6),
)
ID_LISTS = pool(
    [[1, 2]], [[1], [2, 3]], [[]], [[1], []], [[5000]], [[1], "a"],
    st.lists(st.lists(st.integers(0, 4095), min_size=1, max_size=4), max_size=3),
)  # fmt: skip
TEXTS = pool(["a", "b"], ["hi"], [""], [], ["a", 1], st.lists(st.text(max_size=8), max_size=3))
MEDIA = pool(
    *MEDIA_ITEMS,
    MEDIA_ITEMS[:3],
    MEDIA_ITEMS[4:7],
    [MEDIA_ITEMS[0]] * 17,
    [],
    [1],
    st.lists(st.sampled_from(MEDIA_ITEMS), max_size=3),
)
BOOL = pool(True, False)
TOKENS = pool(1, 2, 3, 4, 4, 0, -1, 4096, 4097, 10**12, 2**63, 10**30)
FLOAT = pool(
    0, 0.0, 0.5, 1, 1.0, 1e-9, 1.5e-5, 2.0, 100, 100.5, -0.1, 1e308, 5e-324, st.floats(-1, 3)
)
# No top_p below float32's smallest subnormal (~1.4e-45) until the sampler takes it: it kills the
# scheduler, and with it the shared server (test_top_p_that_rounds_to_zero_in_float32_...).
TOP_P = pool(1, 0.9, 0.5, 1e-9, 1e-45, 5e-324, 0, -0.1, 1.1, st.floats(1e-40, 1))
INT = pool(
    -1,
    0,
    1,
    5,
    4095,
    4096,
    10**6,
    -2,
    2**31,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63) - 1,
    10**30,
    st.integers(-5, 50),
)
STOP = pool("\n", "the", "", ["a", "b"], [""], [], [1], st.text(max_size=4))
MODEL = pool(
    DEFAULT_MODEL_NAME, DEFAULT_MODEL_NAME, DEFAULT_MODEL_NAME, "gpt-4o", "", "../etc/passwd"
)
RID = pool("r1", "r2", "", "x" * 256, "x" * 257, st.text(max_size=8))

SAMPLING_FIELDS = {
    "max_new_tokens": TOKENS, "min_new_tokens": pool(0, 1, 3, 5, -1), "temperature": FLOAT,
    "top_p": TOP_P, "top_k": INT, "seed": INT, "stop": STOP, "stop_token_ids": IDS,
    "ignore_eos": BOOL, "stream_interval": pool(1, 2, 0, -1, None, 10**30),
    "skip_special_tokens": BOOL, "no_stop_trim": BOOL,
}  # fmt: skip
OPENAI_FIELDS = {
    "model": MODEL, "temperature": FLOAT, "top_p": TOP_P, "seed": INT, "stop": STOP,
    # (n = 128 runs 128 sequences: too dear here)
    "n": pool(1, 2, 3, 8, 0, -1, 129, 10**20), "stream": BOOL,
    "stream_options": pool({"include_usage": True}, {"include_usage": False},
        {"include_obfuscation": True}, {"x": 1}),
    "frequency_penalty": FLOAT, "presence_penalty": FLOAT,
    "logit_bias": pool({}, {"1": 5}, {"x": 1.0}, {"1": "a"}),
    "user": TEXT, "top_k": INT, "min_tokens": pool(0, 1, 5, -1), "ignore_eos": BOOL,
    "stop_token_ids": IDS,
    "skip_special_tokens": BOOL,
}  # fmt: skip


@st.composite
def message(draw: Any) -> dict[str, Any]:
    out = {
        "role": draw(
            pool("system", "developer", "user", "user", "assistant", "tool", "function", "bot", "")
        )
    }
    content = _value(draw, pool(
        MISSING, None, "hi", "Tell me a story", "", "<|im_end|>", [],
        [{"type": "text", "text": "a"}],
        [{"type": "text", "text": "a"}, {"type": "refusal", "refusal": "no"}],
        [{"type": "image_url", "image_url": {"url": MEDIA_ITEMS[1]}}],
        [{"type": "input_audio", "input_audio": {}}], [{"type": "video", "text": "a"}],
        [{"text": "no type"}], [{"type": "text"}], TEXT, JUNK,
    ))  # fmt: skip
    if content is not MISSING:
        out["content"] = content
    extra = draw(pool(
        MISSING, MISSING, ("name", "bob"), ("tool_call_id", "1"), ("refusal", "no"),
        ("tool_calls", [{"id": "1"}]), ("audio", {"id": "a"}), ("weight", 1),
        ("reasoning", "hm"), ("reasoning_content", None), ("annotations", []),
    ))  # fmt: skip
    if extra is not MISSING:
        out[extra[0]] = extra[1]
    return out


MESSAGES = pool(
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story"}],
    [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"},
    ],
    st.lists(message(), min_size=1, max_size=3),
    st.lists(message(), max_size=3),
)

ITEM_KEYS = ["type", "role", "content", "call_id", "output", "name", "arguments", "id", "status"]
ITEM_KEYS += ["summary", "encrypted_content"]
RESPONSE_ITEMS = pool(
    [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
    [
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "x"},
    ],
    [{"type": "function_call_output", "call_id": "nope", "output": "x"}],
    [
        {"type": "reasoning", "id": "rs", "summary": []},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "b"},
    ],
    [{"type": "item_reference", "id": "x"}],
    st.lists(st.dictionaries(st.sampled_from(ITEM_KEYS), junk_tree, max_size=4), max_size=3),
)

# Per endpoint: the main field (present 9 times in 10), then the others.
FIELDS: dict[str, tuple[str, dict[str, st.SearchStrategy[Any]]]] = {
    "/generate": ("text", {
        "text": TEXT, "input_ids": IDS, "sampling_params": pool(MISSING), "stream": BOOL,
        "rid": RID,
        "image_data": MEDIA, "audio_data": MEDIA, "video_data": MEDIA,
    }),
    "/v1/completions": ("prompt", {
        **OPENAI_FIELDS, "prompt": pool(TEXT, TEXT, IDS, TEXTS, ID_LISTS), "max_tokens": TOKENS,
        "echo": BOOL, "logprobs": pool(None, 0, 3), "suffix": TEXT, "best_of": pool(1, 2, 0),
    }),
    "/v1/chat/completions": ("messages", {
        **OPENAI_FIELDS, "messages": MESSAGES, "max_tokens": TOKENS,
        "max_completion_tokens": TOKENS,
        "logprobs": BOOL, "top_logprobs": pool(None, 0, 3),
        "tools": pool([], [{"type": "function"}]),
        "tool_choice": pool("none", "auto", {"type": "function"}),
        "response_format": pool({"type": "text"}, {"type": "json_object"}, {"type": "xml"},
            {"type": "json_schema", "json_schema": {}}),
        "modalities": pool(["text"], ["audio"], ["video"]), "metadata": pool({"a": "b"}, {"a": 1}),
        "store": BOOL,
        "prediction": JUNK, "web_search_options": pool({}, None),
    }),
    "/v1/responses": ("input", {
        **OPENAI_FIELDS, "input": pool(TEXT, TEXT, MESSAGES, RESPONSE_ITEMS),
        "max_output_tokens": TOKENS,
        "instructions": TEXT,
        "tools": pool([], [{"type": "function"}], [{"type": "web_search"}],
            [{"type": "function", "name": "f"}]),
        "tool_choice": pool("none", "auto", "required", {"type": "function", "name": "f"},
            {"type": "file_search"}),
        "text": pool({"format": {"type": "text"}}, {"format": {"type": "json_object"}},
            {"format": {"type": "json_schema"}}, {}),
        "previous_response_id": pool("resp_x", RID), "store": BOOL, "include": pool([], ["x"]),
        "background": BOOL,
        "reasoning": pool({}, {"effort": "low"}, {"effort": "x"}),
        "metadata": pool({"a": "b"}, {"a": 1}),
    }),
    "/v1/embeddings": ("input", {
        "input": pool(TEXT, TEXT, TEXTS, IDS, ID_LISTS), "model": MODEL,
        "encoding_format": pool("float", "base64", "hex"),
        "dimensions": pool(None, 1, 256, -1), "user": TEXT,
    }),
    "/tokenize": ("messages", {
        "messages": MESSAGES, "prompt": pool(TEXT, TEXTS), "add_generation_prompt": BOOL,
        "continue_final_message": BOOL, "tools": pool([], [{"type": "function"}]),
        "chat_template_kwargs": pool({}, {"enable_thinking": False}), "add_special_tokens": BOOL,
        "return_token_strs": BOOL, "chat_template": pool(None, "{{ messages }}"),
    }),
    "/encode": ("text", {"text": pool(TEXT, TEXTS), "input_ids": pool(IDS, ID_LISTS), "rid": RID}),
    "/abort_request": ("rid", {"rid": RID, "abort_all": BOOL}),
}  # fmt: skip
ALL_FIELD_NAMES = sorted(
    {name for _, fields in FIELDS.values() for name in fields} | set(SAMPLING_FIELDS)
)


def _value(draw: Any, strategy: st.SearchStrategy[Any]) -> Any:
    value = draw(strategy)
    while isinstance(value, st.SearchStrategy):
        value = draw(value)
    return value


@st.composite
def json_object(
    draw: Any, main: str | None, fields: dict[str, st.SearchStrategy[Any]]
) -> dict[str, Any]:
    """The main field (usually), a few others, each plausible or, in a dirty body, sometimes
    junk, and now and then a stray key."""
    dirty = draw(st.booleans())
    names = draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True))
    if main is not None and main not in names and draw(st.integers(0, 9)) > 0:
        names.insert(0, main)
    out: dict[str, Any] = {}
    for name in names:
        if dirty and draw(st.integers(0, 3)) == 0:
            out[name] = _value(draw, JUNK)
        elif name == "sampling_params":
            out[name] = draw(json_object(None, SAMPLING_FIELDS))
        else:
            out[name] = _value(draw, fields[name])
    if dirty and draw(st.integers(0, 4)) == 0:
        out[draw(st.sampled_from(ALL_FIELD_NAMES) | st.text(max_size=8))] = _value(draw, JUNK)
    return out


def _capped(value: Any) -> Any:
    if value is MISSING:
        return TOKEN_CAP
    if type(value) is int and TOKEN_CAP < value <= MAX_NEW_TOKENS_LIMIT:
        return TOKEN_CAP
    return value


def cap_tokens(path: str, body: Any) -> None:
    """A valid body generates at most TOKEN_CAP tokens; junk values are left as they are."""
    if not isinstance(body, dict):
        return
    if path == "/generate":
        sampling = body.get("sampling_params", {})
        if isinstance(sampling, dict):
            body["sampling_params"] = {
                **sampling,
                "max_new_tokens": _capped(sampling.get("max_new_tokens", MISSING)),
            }
    elif path == "/v1/completions":
        body["max_tokens"] = _capped(body.get("max_tokens", MISSING))
    elif path == "/v1/responses":
        body["max_output_tokens"] = _capped(body.get("max_output_tokens", MISSING))
    elif path == "/v1/chat/completions":
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = TOKEN_CAP
        for key in ("max_tokens", "max_completion_tokens"):
            if key in body:
                body[key] = _capped(body[key])


# (target, path), weighted by repetition: the generate server takes every endpoint (the
# embedding ones get 400 there), the embedding server its own two and a few others.
POST_TARGETS = (
    [("gen", "/generate")] * 6
    + [("gen", "/v1/completions")] * 4
    + [("gen", "/v1/chat/completions")] * 4
    + [("gen", "/v1/responses")] * 3
    + [
        ("gen", "/abort_request"),
        ("gen", "/v1/embeddings"),
        ("gen", "/encode"),
        ("gen", "/tokenize"),
    ]
    + [("emb", "/v1/embeddings")] * 3
    + [("emb", "/encode")] * 3
    + [("emb", "/generate"), ("emb", "/v1/completions"), ("emb", "/abort_request")]
)


@st.composite
def post_case(draw: Any) -> Case:
    target, path = draw(st.sampled_from(POST_TARGETS))
    form = draw(st.integers(0, 19))
    content_type = {3: "text/plain", 4: None}.get(form, "application/json")
    if form == 0:
        return Case(target, "POST", path, draw(st.binary(min_size=1, max_size=48)), content_type)
    if form == 1:
        return Case(
            target,
            "POST",
            path,
            json.dumps(_value(draw, JUNK), allow_nan=True).encode(),
            content_type,
        )
    main, fields = FIELDS[path]
    body = draw(json_object(main, fields))
    cap_tokens(path, body)
    text = json.dumps(body, allow_nan=True, ensure_ascii=form > 6)  # 5, 6: raw UTF-8
    if form == 2:
        text = text[: draw(st.integers(1, max(1, len(text) - 1)))]  # truncated
    return Case(target, "POST", path, text.encode(), content_type)


GET_PATHS = [
    "/health",
    "/metrics",
    "/server_info",
    "/v1/models",
    f"/v1/models/{DEFAULT_MODEL_NAME}",
    "/nope",
    "/",
]
junk_query = st.binary(max_size=40).map(lambda b: quote_from_bytes(b, safe="=&;%+/?:@!$'()*,"))


@st.composite
def get_case(draw: Any) -> Case:
    target = draw(st.sampled_from(["gen", "gen", "emb"]))
    kind = draw(st.integers(0, 19))
    if kind == 0:
        path = "/health_generate"  # a real 1-token request: rarely
    elif kind == 1:
        path = "/v1/models/" + quote(draw(st.text(max_size=12)), safe="")
    elif kind == 2:  # wrong method
        path = draw(
            st.sampled_from(["/generate", "/v1/completions", "/v1/embeddings", "/abort_request"])
        )
    else:
        path = draw(st.sampled_from(GET_PATHS))
    query = draw(junk_query)
    method = "POST" if kind == 3 else "GET"  # kind 3: POST to a GET route
    return Case(target, method, f"{path}?{query}" if query else path, None, None)


# --- sending and checking -------------------------------------------------------------------


def check_answer(case: Case, resp: httpx.Response) -> str | None:
    """None when the answer is a 4xx error body or a well-formed success; else the problem."""
    status = resp.status_code
    if status == 503 and "aborted by /abort_request" in resp.text:
        # A fuzzed {"abort_all": true} raced with this request: a correct answer to that.
        return None
    if status >= 500:
        return f"HTTP {status}: {resp.text[:300]}"
    if 400 <= status < 500:
        try:
            error = resp.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"HTTP {status} without a JSON error body: {resp.text[:300]}"
        if not (
            isinstance(error.get("message"), str)
            and error.get("code") == status
            and isinstance(error.get("type"), str)
        ):
            return f"HTTP {status} with a malformed error body: {error}"
        return None
    if status != 200:
        return f"unexpected HTTP {status}"
    path = case.path.split("?", 1)[0]
    ctype = resp.headers.get("content-type", "")
    if ctype.startswith("text/event-stream"):
        if path == "/v1/responses":  # named events, no [DONE]: the last says how it ended
            last = [line for line in resp.text.split("\n") if line.startswith("data: ")][-1:]
            ended = json.loads(last[0][len("data: ") :]) if last else {}
            if (
                ended.get("type") not in ("response.completed", "response.incomplete")
                and "error" not in ended
            ):
                return f"responses stream did not end with its response: {resp.text[-300:]}"
            return None
        events = [
            line[len("data: ") :] for line in resp.text.split("\n\n") if line.startswith("data: ")
        ]
        if not events or events[-1] != "[DONE]":
            return f"stream did not end with [DONE]: {resp.text[-300:]}"
        for event in events[:-1]:
            json.loads(event)
        return None
    if path in ("/health", "/metrics"):
        return None
    body = resp.json()
    expected = {
        "/generate": "meta_info",
        "/v1/completions": "choices",
        "/v1/chat/completions": "choices",
        "/v1/responses": "output",
        "/v1/embeddings": "data",
        "/abort_request": "aborted",
        "/health_generate": "status",
        "/server_info": "live_requests",
        "/v1/models": "data",
        "/tokenize": "tokens",
    }.get(path)
    if path == "/encode":
        items = body if isinstance(body, list) else [body]
        if not items or not all("embedding" in item for item in items):
            return f"malformed /encode answer: {str(body)[:300]}"
    elif expected is not None and expected not in body:
        return f"200 without {expected!r}: {str(body)[:300]}"
    return None


class Dispatcher:
    """WORKERS threads, each with its own httpx clients, send queued cases and check them."""

    def __init__(self, urls: dict[str, str]) -> None:
        self.urls = urls
        self.queue: queue.Queue[Case | None] = queue.Queue(maxsize=8 * WORKERS)
        self.failures: list[tuple[Case, str]] = []
        self.statuses: Counter[tuple[str, int]] = Counter()
        self.slowest = 0.0
        self.retried = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._work, daemon=True) for _ in range(WORKERS)]
        for t in self._threads:
            t.start()

    def put(self, case: Case) -> None:
        self.queue.put(case, timeout=REQUEST_TIMEOUT * 2)

    def _work(self) -> None:
        clients = {
            name: httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT)
            for name, url in self.urls.items()
        }
        try:
            while (case := self.queue.get()) is not None:
                started = time.monotonic()
                status = -1
                headers = {"content-type": case.content_type} if case.content_type else {}
                for attempt in (1, 2):
                    try:
                        resp = clients[case.target].request(
                            case.method, case.path, content=case.content, headers=headers
                        )
                        status = resp.status_code
                        problem = check_answer(case, resp)
                    except httpx.TimeoutException:
                        problem = f"no answer within {REQUEST_TIMEOUT:.0f} s (hang)"
                    except (httpx.ReadError, httpx.RemoteProtocolError) as exc:
                        problem = f"{type(exc).__name__}: {exc}"
                        if attempt == 1:
                            # A keep-alive connection the server closed as it was reused; a
                            # body that really breaks the connection fails again.
                            with self._lock:
                                self.retried += 1
                            continue
                    # every failure is reported with its case
                    except Exception as exc:  # noqa: BLE001
                        problem = f"{type(exc).__name__}: {exc}"
                    break
                took = time.monotonic() - started
                with self._lock:
                    self.statuses[(case.path.split("?", 1)[0], status)] += 1
                    self.slowest = max(self.slowest, took)
                    if problem is not None:
                        self.failures.append((case, problem))
                self.queue.task_done()
        finally:
            for c in clients.values():
                c.close()

    def finish(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not self.queue.unfinished_tasks, (
            f"{self.queue.unfinished_tasks} requests still unanswered (hang)"
        )
        for _ in self._threads:
            self.queue.put(None)
        for t in self._threads:
            t.join(5)

    @property
    def sent(self) -> int:
        return sum(self.statuses.values())

    def report(self) -> str:
        lines = [
            f"{len(self.failures)} failures of {self.sent} requests; slowest answer "
            f"{self.slowest:.2f} s; "
            f"{self.retried} resent after a dropped keep-alive connection"
        ]
        for case, problem in self.failures[:15]:
            content = case.content[:300] if case.content is not None else None
            lines.append(
                f"  {case.target} {case.method} {case.path[:80]} {content!r}\n    -> {problem}"
            )
        return "\n".join(lines)


FUZZ_SETTINGS = dict(
    deadline=None,
    database=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],  # the test body never fails: nothing to shrink
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)


@pytest.fixture(scope="module")
def embedding_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        tmp_path_factory.mktemp("fuzz-embed") / "tmp",
        ["--mode", "embedding", "--max-total-tokens", "4096"],
    )
    request.getfixturevalue(
        "server"
    )  # the shared server starts (if it has not yet) while this one does
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def urls(server: ServerProcess, embedding_server: ServerProcess) -> dict[str, str]:
    models = httpx.get(server.url + "/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [
        DEFAULT_MODEL_NAME
    ]  # the strategies' valid model name
    return {"gen": server.url, "emb": embedding_server.url}


def _assert_healthy(urls: dict[str, str]) -> None:
    for name, url in urls.items():
        r = httpx.get(url + "/health_generate", timeout=30)
        assert r.status_code == 200, (name, r.status_code, r.text)
        assert httpx.get(url + "/health", timeout=5).status_code == 200


def _deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


_CHAT = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '


@pytest.mark.timeout(300)
def test_fuzzed_post_bodies_get_4xx_or_a_valid_answer(urls: dict[str, str]) -> None:
    dispatcher = Dispatcher(urls)

    def raw(target: str, path: str, content: bytes) -> list[Case]:
        return [Case(target, "POST", path, content, "application/json")]

    @settings(max_examples=POST_EXAMPLES // BATCH, **FUZZ_SETTINGS)  # type: ignore[arg-type]
    @given(st.lists(post_case(), min_size=BATCH, max_size=BATCH))
    # Found by this test (500s before the fix in tokenizer_proc.request_edge.body.decode_body):
    # integers that no 64-bit wire field can carry, and nesting past the JSON decoder's recursion
    # limit inside a free-form (Any) field.
    @example(
        raw(
            "gen",
            "/generate",
            b'{"text": "a", "sampling_params": {"max_new_tokens": 2, "top_k": '
            b"100000000000000000000000}}",
        )
    )
    @example(
        raw(
            "gen",
            "/generate",
            b'{"text": "a", "sampling_params": {"max_new_tokens": 2, "stop_token_ids": '
            b"[18446744073709551616]}}",
        )
    )
    @example(
        raw(
            "gen",
            "/v1/completions",
            b'{"prompt": "a", "max_tokens": 2, "top_k": 100000000000000000000000}',
        )
    )
    @example(raw("gen", "/v1/chat/completions", _CHAT + b'"tool_choice": ' + _deep(5000) + b"}"))
    @example(raw("gen", "/v1/chat/completions", _CHAT + b'"prediction": ' + _deep(100_000) + b"}"))
    @example(raw("emb", "/encode", b'{"input_ids": [1, 18446744073709551616]}'))
    @example(raw("emb", "/v1/embeddings", b'{"input": ' + _deep(100_000) + b"}"))
    def feed(cases: list[Case]) -> None:
        for case in cases:
            dispatcher.put(case)

    started = time.monotonic()
    feed()
    generated = time.monotonic() - started
    dispatcher.finish()
    took = time.monotonic() - started
    print(
        f"\n{dispatcher.sent} POSTs in {took:.1f} s (generated in {generated:.1f} s); "
        f"{dispatcher.report()}"
    )
    print("statuses:", dict(sorted(dispatcher.statuses.items())))
    assert dispatcher.sent >= POST_EXAMPLES
    assert not dispatcher.failures, dispatcher.report()
    assert any(status == 200 for (_, status) in dispatcher.statuses), "no generated body was valid"
    _assert_healthy(urls)


@pytest.mark.timeout(120)
def test_fuzzed_gets_with_junk_query_strings(urls: dict[str, str]) -> None:
    dispatcher = Dispatcher(urls)

    @settings(max_examples=GET_EXAMPLES, **FUZZ_SETTINGS)  # type: ignore[arg-type]
    @given(get_case())
    def feed(case: Case) -> None:
        dispatcher.put(case)

    started = time.monotonic()
    feed()
    dispatcher.finish()
    print(f"\n{dispatcher.sent} GETs in {time.monotonic() - started:.1f} s; {dispatcher.report()}")
    assert dispatcher.sent >= GET_EXAMPLES
    assert not dispatcher.failures, dispatcher.report()
    _assert_healthy(urls)


# --- regressions for bugs this test found outside the HTTP layer ---------------------------------


def test_top_p_that_rounds_to_zero_in_float32_still_samples_the_top_token() -> None:
    import torch

    from pipeline.io_struct import SamplingParams
    from scheduler_proc.sampling.sampler import SamplingColumns, draw_counter, sample

    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0, top_p=top_p) for top_p in (5e-324, 1e-46)]
    cols = SamplingColumns.from_requests(
        params, [0, 0], [draw_counter(0)] * 2, [[], []], [[], []], 64, "cpu"
    )
    assert (
        sample(logits, cols).tolist() == torch.argmax(logits, dim=-1).tolist()
    )  # the first token always survives


def test_an_embedding_input_of_exactly_the_context_length_is_embedded_or_refused(
    embedding_server: ServerProcess,
) -> None:
    context = httpx.get(embedding_server.url + "/server_info", timeout=30).json()["context_length"]
    r = httpx.post(
        embedding_server.url + "/v1/embeddings", json={"input": [7] * context}, timeout=60
    )
    if r.status_code == 200:
        vector = r.json()["data"][0]["embedding"]
        assert abs(sum(x * x for x in vector) - 1.0) < 1e-3, "a 200 with a zero vector"
    else:
        assert r.status_code == 400, r.text
