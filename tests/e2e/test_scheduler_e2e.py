"""The scheduler's real events through real processes: prefix-cache hits, retraction and
re-prefill under a small KV pool, admission refusal, media placeholders, and the
scheduler gauges on /metrics (its torch thread count among them)."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import time
import wave
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from PIL import Image

from tests.server_harness import ServerProcess

POOL = 1536


@pytest.fixture(scope="module")
def small_pool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        tmp_path_factory.mktemp("small-pool") / "tmp",
        ["--max-total-tokens", str(POOL), "--chunked-prefill-size", "64"],
    ).wait_ready()
    yield srv
    srv.stop()


def stream_text(
    c: httpx.Client,
    body: dict,  # type: ignore[type-arg]
) -> tuple[str, list[int], dict]:  # type: ignore[type-arg]
    """The last event's text, ids and meta_info: each event holds the output so far."""
    text, ids, meta = "", [], {}
    with c.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                text, ids, meta = event["text"], event["output_ids"], event["meta_info"]
    return text, ids, meta


def wait_idle(c: httpx.Client, timeout: float = 30.0) -> dict:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout
    while True:
        info = c.get("/server_info").json()
        sched = info["scheduler"]
        if (
            sched and sched["live_reqs"] == 0 and info["live_requests"] == 0
        ) or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


def test_shared_prefix_reports_cached_tokens(small_pool_server: ServerProcess) -> None:
    # The small-pool server, first: its cache is empty. The shared server's holds the fuzz
    # test's random prompts, any of which may start with this prefix's first token.
    shared = [(7 * i + 11) % 3000 + 100 for i in range(64)]
    sampling = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    with small_pool_server.client() as c:
        first = c.post(
            "/generate", json={"input_ids": shared + [3001, 3002], "sampling_params": sampling}
        ).json()
        second = c.post(
            "/generate",
            json={"input_ids": shared + [3003, 3004, 3005], "sampling_params": sampling},
        ).json()
    assert first["meta_info"]["cached_tokens"] == 0
    assert first["meta_info"]["cached_tokens_details"] is None
    assert second["meta_info"]["cached_tokens"] == 64
    assert second["meta_info"]["cached_tokens_details"] == {"device": 64, "host": 0}
    assert second["meta_info"]["prompt_tokens"] == 67


def test_retractions_keep_text_and_are_counted_exactly(small_pool_server: ServerProcess) -> None:
    srv = small_pool_server
    bodies = [
        {"text": f"Request {i}: tell me a long story about {i * 7} ships", "rid": f"ret-{i}",
         "sampling_params": {"max_new_tokens": 150, "temperature": 0, "ignore_eos": True}}
        for i in range(32)
    ]  # fmt: skip
    with srv.client() as c:
        alone = {
            b["rid"]: c.post("/generate", json={**b, "rid": b["rid"] + "-alone"}).json()
            for b in bodies
        }
    assert all(a["meta_info"]["num_retractions"] == 0 for a in alone.values())
    log_before = srv.output()

    def run(body: dict) -> tuple[str, list[int], dict]:  # type: ignore[type-arg]
        with srv.client() as c:
            return stream_text(c, body)

    with ThreadPoolExecutor(32) as pool:
        results = dict(zip((b["rid"] for b in bodies), pool.map(run, bodies)))

    with srv.client() as c:
        info = wait_idle(c)
    retracted = Counter(
        re.findall(r"retracted req_id=\d+ rid=(\S+)", srv.output()[len(log_before) :])
    )
    assert sum(retracted.values()) > 0, (
        "the pool should have been too small for 32 long generations"
    )
    for rid, (text, ids, meta) in results.items():
        assert meta["finish_reason"] == {"type": "length", "length": 150}
        assert meta["num_retractions"] == retracted.get(rid, 0), rid
        assert ids == alone[rid]["output_ids"], f"{rid}: retraction changed the tokens"
        assert text == alone[rid]["text"]
    retracted_requests = [rid for rid in results if retracted.get(rid)]
    assert retracted_requests and max(retracted.values()) >= 1
    sched = info["scheduler"]
    assert sched["live_reqs"] == 0 and sched["token_usage"] == 0.0, sched
    assert sched["num_retracted_requests_total"] >= sum(retracted.values())


def test_request_that_can_never_fit_is_refused_at_once(small_pool_server: ServerProcess) -> None:
    with small_pool_server.client() as c:
        started = time.monotonic()
        resp = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": POOL}})
    assert resp.status_code == 400 and time.monotonic() - started < 2.0
    assert "KV pool" in resp.json()["error"]["message"]


def _png(w: int, h: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 10, 10)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _wav(seconds: float, rate: int = 16000) -> str:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\0\0" * int(seconds * rate))
    return base64.b64encode(buf.getvalue()).decode()


def _gif(frames: int, w: int, h: int) -> str:
    buf = io.BytesIO()
    images = [Image.new("RGB", (w, h), (40 * i, 255 - 40 * i, 0)) for i in range(frames)]
    images[0].save(buf, format="GIF", save_all=True, append_images=images[1:])
    return base64.b64encode(buf.getvalue()).decode()


def test_media_placeholders_are_counted_per_kind(server: ServerProcess) -> None:
    body = {
        "text": "Describe these.",
        "image_data": [_png(100, 60), _png(28, 28)],  # 4*3 + 1 = 13 tokens
        "audio_data": _wav(1.0),  # 25 tokens
        "video_data": [_gif(3, 100, 60)],  # 3 frames * 2*2 = 12 tokens
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
    }
    with server.client() as c:
        plain = c.post(
            "/generate", json={"text": body["text"], "sampling_params": body["sampling_params"]}
        ).json()
        out = c.post("/generate", json=body).json()
        bad = c.post("/generate", json={**body, "image_data": ["not base64!!"]})
    meta = out["meta_info"]
    assert (meta["image_tokens"], meta["audio_tokens"], meta["video_tokens"]) == (13, 25, 12)
    assert meta["prompt_tokens"] == plain["meta_info"]["prompt_tokens"] + 13 + 25 + 12
    assert "image_tokens" not in plain["meta_info"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "image_data[0]"


def test_scheduler_gauges_on_metrics(server: ServerProcess) -> None:
    with server.client() as c:
        c.post("/generate", json={"text": "warm", "sampling_params": {"max_new_tokens": 4}})
        wait_idle(c)
        text = c.get("/metrics").text
    for name in (
        "num_running_reqs",
        "num_queue_reqs",
        "token_usage",
        "cache_hit_rate",
        "gen_throughput",
        "num_retracted_reqs",
        "num_retracted_requests_total",
    ):
        assert re.search(
            rf'^tokenpipe:{name}\{{engine_type="unified",model_name="tokenpipe-tiny"\}} ',
            text,
            re.M,
        ), name
    assert re.search(r"^tokenpipe:num_running_reqs\{.*\} 0\.0$", text, re.M)


def test_scheduler_reports_its_torch_threads(server: ServerProcess) -> None:
    """The thread count the scheduler process set for torch (here the default, which follows
    the idle cores: one to all this machine lets it use) reaches /server_info and /metrics."""
    cores = len(os.sched_getaffinity(0))
    with server.client() as c:
        c.post("/generate", json={"text": "warm", "sampling_params": {"max_new_tokens": 4}})
        threads = wait_idle(c)["scheduler"]["torch_threads"]
        text = c.get("/metrics").text
    assert 1 <= threads <= cores
    gauge = re.search(r"^tokenpipe:torch_threads\{.*\} (\S+)$", text, re.M)
    assert gauge is not None and 1 <= float(gauge[1]) <= cores


def test_server_log_has_no_tracebacks(server: ServerProcess, tmp_path: Path) -> None:
    assert "Traceback" not in server.output()
