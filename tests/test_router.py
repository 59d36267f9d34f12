"""``tokenpipe router`` as a real process in front of real servers (or of ports nothing
listens on): it names the server that is down or in the wrong mode, refuses bodies it cannot
split, checks the API key, and (end to end) gives the same greedy output through a prefill
and a decode server as one unified server gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server_harness import REPO, ServerProcess, free_port, wait_until

API_KEY = "tp-router-Secret-0123456789"
PD_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
BODIES = {
    "/generate": {"text": "hello", "sampling_params": {"max_new_tokens": 2}},
    "/v1/completions": {"prompt": "hello", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2},
}


class RouterProcess:
    """``tokenpipe router`` in a subprocess, its output in a log file next to the test's tmp dir."""

    def __init__(self, log_dir: Path, prefill_url: str, decode_url: str, *args: str) -> None:
        self.port = free_port()
        self.prefill_url, self.decode_url = prefill_url, decode_url
        self.log_path = log_dir / f"router-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "router", "--prefill-url", prefill_url, "--decode-url", decode_url, "--port", str(self.port), *args],
            cwd=REPO,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 60.0) -> "RouterProcess":
        # Any answer from /health means it serves; with its servers down that answer is a 503.
        def answering() -> bool:
            try:
                httpx.get(self.url + "/health", timeout=10.0)
            except httpx.HTTPError:
                return self.proc.poll() is not None
            return True

        if not wait_until(answering, timeout, interval=0.1) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"router did not start; output:\n{self.output()[-4000:]}")
        return self

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120.0, **kwargs)  # type: ignore[arg-type]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # the port was free a moment ago: nothing listens


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("router-logs")


@pytest.fixture(scope="module")
def router_to_nothing(logs: Path) -> Iterator[RouterProcess]:
    router = RouterProcess(logs, _dead_url(), _dead_url()).wait_ready()
    yield router
    assert router.stop() == 0, router.output()[-2000:]


@pytest.fixture(scope="module")
def router_to_unified(logs: Path, server: ServerProcess) -> Iterator[RouterProcess]:
    """Both "halves" are one unified server: running, but in neither PD mode."""
    router = RouterProcess(logs, server.url, server.url).wait_ready()
    yield router
    router.stop()


@pytest.fixture(scope="module")
def keyed_router(logs: Path) -> Iterator[RouterProcess]:
    router = RouterProcess(logs, _dead_url(), _dead_url(), "--api-key", API_KEY).wait_ready()
    yield router
    router.stop()


def _error(response: httpx.Response) -> dict[str, object]:
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"]), body
    assert body["error"]["code"] == response.status_code
    return body["error"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("path", PD_PATHS)
def test_unreachable_prefill_server_is_a_quick_502_naming_it(router_to_nothing: RouterProcess, path: str) -> None:
    prefill_url = router_to_nothing.prefill_url
    started = time.monotonic()
    with router_to_nothing.client() as client:
        response = client.post(path, json=BODIES[path])
    assert time.monotonic() - started < 10
    assert response.status_code == 502
    error = _error(response)
    assert prefill_url in str(error["message"]) and "unreachable" in str(error["message"])
    assert error["type"] == "bad_gateway"


def test_health_is_503_naming_each_server_that_is_down(router_to_nothing: RouterProcess) -> None:
    prefill_url, decode_url = router_to_nothing.prefill_url, router_to_nothing.decode_url
    with router_to_nothing.client() as client:
        response = client.get("/health")
    assert response.status_code == 503
    message = str(_error(response)["message"])
    assert f"prefill server {prefill_url}" in message and f"decode server {decode_url}" in message


def test_discovery_failure_is_not_kept(router_to_nothing: RouterProcess) -> None:
    # Every request asks the servers again, so each one still reports the real cause quickly.
    with router_to_nothing.client() as client:
        for _ in range(3):
            assert client.post("/generate", json=BODIES["/generate"]).status_code == 502


@pytest.mark.parametrize("path", PD_PATHS)
@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"not json", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"[1, 2]", "not a JSON array"),
        (b'"text"', "not a JSON string"),
        (b"null", "not a JSON null"),
    ],
)
def test_body_that_is_not_a_json_object_is_400(router_to_nothing: RouterProcess, path: str, body: bytes, expected: str) -> None:
    # The body is checked before the servers are asked: a client error does not depend on them.
    with router_to_nothing.client() as client:
        response = client.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    error = _error(response)
    assert "must be a JSON object" in str(error["message"]) and expected in str(error["message"])
    assert error["type"] == "invalid_request_error"


def test_unknown_path_is_a_json_404(router_to_nothing: RouterProcess) -> None:
    with router_to_nothing.client() as client:
        response = client.get("/no/such/path")
    assert response.status_code == 404 and _error(response)["type"] == "not_found_error"


@pytest.mark.parametrize("path", PD_PATHS)
def test_server_not_in_prefill_mode_is_502_saying_so(router_to_unified: RouterProcess, server: ServerProcess, path: str) -> None:
    with router_to_unified.client() as client:
        response = client.post(path, json=BODIES[path])
    assert response.status_code == 502
    message = str(_error(response)["message"])
    assert f"prefill server {server.url} is not in prefill mode" in message
    assert "disaggregation_mode 'null'" in message


def test_server_info_health_and_models_come_from_the_servers(router_to_unified: RouterProcess, server: ServerProcess) -> None:
    with router_to_unified.client() as client, server.client() as direct:
        info = client.get("/server_info")
        health = client.get("/health")
        models = client.get("/v1/models")
        direct_models = direct.get("/v1/models").json()
    assert info.status_code == 200
    body = info.json()
    assert body["prefill_url"] == server.url and body["decode_url"] == server.url
    assert body["prefill"]["disaggregation_mode"] == "null" and body["decode"]["model_name"] == direct_models["data"][0]["id"]
    assert health.status_code == 200
    assert models.status_code == 200 and models.json() == direct_models


def test_router_with_api_key_refuses_requests_without_it(keyed_router: RouterProcess) -> None:
    with keyed_router.client() as client:
        missing = client.post("/generate", json=BODIES["/generate"])
        wrong = client.post("/generate", json=BODIES["/generate"], headers={"Authorization": f"Bearer {API_KEY}x"})
        info = client.get("/server_info")
        health = client.get("/health")
        right = client.post("/generate", json=BODIES["/generate"], headers={"Authorization": f"Bearer {API_KEY}"})
    for response in (missing, wrong, info):
        assert response.status_code == 401 and _error(response)["type"] == "authentication_error"
    assert health.status_code == 503  # open, like the servers' /health; its servers are down
    assert right.status_code == 502  # past the key check, on to the (unreachable) servers


def test_router_flags_are_checked() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "router", "--prefill-url", "localhost:8000", "--decode-url", "http://127.0.0.1:8001"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "--prefill-url must be an http:// or https:// URL" in run.stderr


# --- end to end: a prefill server, a decode server and the router -------------------------------

GREEDY = {"text": "The quick brown fox", "sampling_params": {"temperature": 0, "max_new_tokens": 12}}
# The prefill server's pool is smaller than the decode server's, so a long prompt is refused by
# the prefill half alone: the way to see that the router then releases the decode half.
PREFILL_POOL = 512


class PD:
    def __init__(self, prefill: ServerProcess, decode: ServerProcess, router: RouterProcess) -> None:
        self.prefill, self.decode, self.router = prefill, decode, router

    def decode_idle(self, timeout: float) -> bool:
        with self.decode.client() as client:
            return wait_until(lambda: client.get("/server_info").json()["live_requests"] == 0, timeout, interval=0.1)

    def decode_aborted(self) -> int:
        with self.decode.client() as client:
            return int(client.get("/server_info").json()["aborted_requests"])


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PD]:
    base = tmp_path_factory.mktemp("pd")
    bootstrap = ["--disaggregation-bootstrap-port", str(free_port())]
    prefill = ServerProcess(base / "prefill", ["--disaggregation-mode", "prefill", *bootstrap, "--max-total-tokens", str(PREFILL_POOL)])
    decode = ServerProcess(base / "decode", ["--disaggregation-mode", "decode"])
    router: RouterProcess | None = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        router = RouterProcess(base, prefill.url, decode.url).wait_ready()
        yield PD(prefill, decode, router)
    finally:
        if router is not None:
            router.stop()
        prefill.stop()
        decode.stop()


def _streamed(client: httpx.Client, path: str, body: dict[str, object]) -> list[dict[str, object]]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all("error" not in chunk for chunk in chunks), chunks
    return chunks


@pytest.mark.timeout(600)
def test_router_pd_end_to_end(server: ServerProcess, pd: PD) -> None:
    with server.client() as unified:
        expected = unified.post("/generate", json=GREEDY).json()
    with pd.router.client() as client:
        response = client.post("/generate", json=GREEDY)
        assert response.status_code == 200, response.text
        got = response.json()
        chunks = _streamed(client, "/generate", GREEDY)
    assert got["output_ids"] == expected["output_ids"] and got["text"] == expected["text"]
    assert [i for c in chunks for i in c["output_ids"]] == expected["output_ids"]  # type: ignore[attr-defined]
    assert "".join(str(c["text"]) for c in chunks) == expected["text"]
    meta = got["meta_info"]
    assert meta["prompt_tokens"] == expected["meta_info"]["prompt_tokens"]
    assert "cached_tokens" in meta
    assert meta.get("bootstrap_done_time") is not None and meta.get("decode_prebuilt_finish_time") is not None
    assert chunks[-1]["meta_info"]["completion_tokens"] == len(expected["output_ids"])  # type: ignore[index]


def test_openai_routes_through_pd(pd: PD) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    with pd.router.client() as client:
        completion = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "temperature": 0, "ignore_eos": True})
        # stream_options is only valid with stream: true, so the router drops it from the prefill half.
        chunks = _streamed(client, "/v1/chat/completions", {**chat, "stream_options": {"include_usage": True}})
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] == 5
    assert chunks[-1]["usage"]["completion_tokens"] == 5  # type: ignore[index]
    assert pd.decode_idle(5)


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_prefill_refusal_is_returned_and_releases_the_decode_half(pd: PD, path: str) -> None:
    long_prompt = list(range(10, 10 + PREFILL_POOL + 100))  # fits the decode server's pool only
    body = {"input_ids": long_prompt, "sampling_params": {"max_new_tokens": 4}} if path == "/generate" else {"prompt": long_prompt, "max_tokens": 4}
    aborted_before = pd.decode_aborted()
    started = time.monotonic()
    with pd.router.client() as client:
        response = client.post(path, json=body)
    # Quickly, not after the decode server's 30 s wait for KV that would never come.
    assert time.monotonic() - started < 10
    assert response.status_code == 400, response.text
    assert _error(response)["type"] == "invalid_request_error"
    assert pd.decode_idle(5)
    assert pd.decode_aborted() > aborted_before


def test_client_gone_mid_stream_aborts_the_decode_half(pd: PD) -> None:
    body = {"text": "a long one", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}, "stream": True}
    aborted_before = pd.decode_aborted()
    with pd.router.client() as client, client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert "output_ids" in first
    assert pd.decode_idle(10)
    assert pd.decode_aborted() > aborted_before
