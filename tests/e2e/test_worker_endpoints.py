"""The endpoints routers call on a worker (tokenizer_proc/http/worker_api.py): /server_info and
/get_server_info, /model_info and /get_model_info, /get_load and /flush_cache.

In process: the scheduler's flush drops the prefix cache on every tier and gives the
slots back, drops nothing while a request is live, and never frees what a request holds.
Against real servers: each endpoint's shape, the API key, the load of running and waiting
requests, and a flush that really empties the cache (a repeated prompt is cached before it
and not after). Through the real sglang-router binary in front of two servers: it registers
them under the served model with the shipped tokenizer, shows their loads, and its own
/flush_cache flushes both (and reports the one that refuses). sglang-router is skipped
when it is not installed, except under CI=true, where that fails the test.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from pipeline.control_frames import FlushCacheControl, FlushCacheResult
from pipeline.tokenizer_loader import DEFAULT_MODEL_NAME, DEFAULT_TOKENIZER_DIR
from scheduler_proc.cache.kv_pool import KVPool
from scheduler_proc.cache.radix_cache import Dropped, RadixCache
from tests.server_harness import ServerProcess, wait_until
from tests.sglang_router import SglangRouter
from tests.e2e.test_hicache import PROMPTS, SUFFIX, hicache_scheduler, serve_one
from tests.unit.test_scheduler_steps import PROMPT, make, run_to_end, submit

API_KEY = "tp-worker-Secret-0123456789"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# Long enough to still run while a test looks at it (it is aborted once the test is done).
LONG_BODY = {"text": "A long one", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
# About 500 tokens: well past one prefill chunk, so a cache hit is unmistakable.
REPEATED = {
    "text": " ".join(f"word{i}" for i in range(200)),
    "sampling_params": {"max_new_tokens": 4, "temperature": 0},
}
IDLE_LOAD = {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
REFUSED = "Cache not flushed because there are pending requests. "


# --- the scheduler, in process ----------------------------------------------------------


def test_flush_drops_every_tier_and_gives_the_slots_back(tmp_path: Path) -> None:
    s = hicache_scheduler(host=128, storage=tmp_path)
    for j in range(4):  # a 256-token device pool and a 128-token host: every tier holds some
        serve_one(s, j + 1, PROMPTS[j])
    assert s.hicache is not None
    tiers = s.hicache.tier_sizes()
    assert min(tiers.values()) > 0, tiers
    result = s.flush_cache(FlushCacheControl(control_id=7))
    assert result == FlushCacheResult(
        control_id=7,
        ok=True,
        device_tokens=tiers["device"],
        host_tokens=tiers["host"],
        storage_tokens=tiers["storage"],
    )
    assert s.kv.num_used == 0 and s.hicache.host.num_used == 0 and s.cache.total_size == 0
    assert s.hicache.tier_sizes() == {"device": 0, "host": 0, "storage": 0}
    s.hicache.check_invariants()
    # As SGLang leaves its storage backend, the files stay; the tree no longer leads to them.
    assert any(p.suffix == ".kv" for p in tmp_path.iterdir())
    _, stats = serve_one(s, 10, PROMPTS[0] + SUFFIX)
    assert stats.cached_tokens == 0  # type: ignore[attr-defined]


def test_flush_is_refused_while_a_request_is_live_and_drops_nothing() -> None:
    s = make(chunk=64)
    submit(s, 1, PROMPT, max_new=4)
    run_to_end(s)
    cached = s.cache.total_size
    submit(s, 2, PROMPT[:50], max_new=4)  # waiting: no step has admitted it yet
    queued = s.flush_cache(FlushCacheControl(control_id=1))
    assert queued == FlushCacheResult(
        control_id=1, ok=False, error=REFUSED + "#queue-req: 1, #running-req: 0"
    )
    s.step()  # admitted: running now
    running = s.flush_cache(FlushCacheControl(control_id=2))
    assert running.error == REFUSED + "#queue-req: 0, #running-req: 1" and not running.ok
    assert s.cache.total_size >= cached, "a refused flush dropped cache"
    run_to_end(s)
    assert s.flush_cache(FlushCacheControl(control_id=3)).ok and s.kv.num_used == 0


def test_dropping_the_cache_keeps_what_a_request_holds() -> None:
    kv = KVPool(1, 64, 1, 2, torch.float32, "cpu", debug=True)  # debug: asserts on a bad free
    cache = RadixCache(kv)
    for ids in ([1, 2, 3, 4, 5, 6], [1, 2, 9, 9], [7, 7, 7]):
        slots = kv.alloc(len(ids))
        assert slots is not None
        cache.insert(ids, slots)
    held, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock(node)  # as a running request locks its prefix
    assert cache.drop_unlocked() == Dropped(device=7, host=0, storage=0)
    assert cache.match_prefix([1, 2, 3, 4, 5, 6])[0].tolist() == held.tolist()
    assert kv.num_used == 4 and cache.protected_size == 4 and cache.evictable_size == 0
    cache.dec_lock(node)
    assert cache.drop_unlocked() == Dropped(device=4, host=0, storage=0)
    assert kv.num_used == 0 and cache.total_size == 0


# --- real servers ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    """Two servers with an API key; the first runs one request at a time, so a second one waits."""
    base = tmp_path_factory.mktemp("workers")
    servers = [
        ServerProcess(base / "a" / "tmp", ["--api-key", API_KEY, "--max-running-requests", "1"]),
        ServerProcess(base / "b" / "tmp", ["--api-key", API_KEY]),
    ]
    try:
        yield [srv.wait_ready() for srv in servers]
    finally:
        for srv in servers:
            srv.stop()


def client(srv: ServerProcess) -> httpx.Client:
    return srv.client(headers=AUTH)


def post_generate(srv: ServerProcess, body: dict[str, Any]) -> httpx.Response:
    with client(srv) as c:
        return c.post("/generate", json=body)


def generate(srv: ServerProcess, body: dict[str, Any]) -> dict[str, Any]:
    resp = post_generate(srv, body)
    assert resp.status_code == 200, resp.text
    return resp.json()["meta_info"]  # type: ignore[no-any-return]


def load(srv: ServerProcess) -> dict[str, int]:
    with client(srv) as c:
        answer = c.get("/get_load").json()
    assert isinstance(answer, list) and len(answer) == 1, answer  # one entry per data-parallel rank
    return answer[0]  # type: ignore[no-any-return]


@contextmanager
def long_requests(
    srv: ServerProcess, *bodies: dict[str, Any]
) -> Iterator[list[Future[httpx.Response]]]:
    """Requests that run (or wait) until the block ends, then are aborted by rid."""
    with ThreadPoolExecutor(len(bodies)) as pool:
        futures = [pool.submit(post_generate, srv, body) for body in bodies]
        try:
            yield futures
        finally:
            with client(srv) as c:
                for body in bodies:
                    c.post("/abort_request", json={"rid": body["rid"]})
            for future in futures:
                future.result(60)


def test_worker_endpoints_need_the_api_key(workers: list[ServerProcess]) -> None:
    for method, path in (
        ("GET", "/server_info"),
        ("GET", "/get_server_info"),
        ("GET", "/model_info"),
        ("GET", "/get_model_info"),
        ("GET", "/get_load"),
        ("POST", "/flush_cache"),
        ("GET", "/flush_cache"),
    ):
        resp = httpx.request(method, workers[0].url + path, timeout=30)
        assert resp.status_code == 401, (path, resp.text)
        assert resp.json()["error"]["code"] == 401


def test_server_info_is_sglangs_shape_under_both_names(workers: list[ServerProcess]) -> None:
    with client(workers[0]) as c:
        info, legacy = c.get("/server_info").json(), c.get("/get_server_info").json()
    for answer in (info, legacy):
        # What sglang-router reads when it registers a worker.
        assert answer["dp_size"] == 1 and answer["tp_size"] == 1
        assert answer["served_model_name"] == answer["model_name"] == DEFAULT_MODEL_NAME
        assert answer["model_path"] == answer["tokenizer_path"] == str(DEFAULT_TOKENIZER_DIR)
        assert (Path(answer["model_path"]) / "tokenizer.json").is_file()
        assert answer["disaggregation_mode"] == "null" and answer["is_generation"] is True
        assert answer["model_type"] == "llama" and answer["architectures"] == ["LlamaForCausalLM"]
        # What tokenpipe's own clients read, unchanged.
        assert {
            "live_requests",
            "aborted_requests",
            "scheduler",
            "context_length",
            "vocab_size",
        } <= answer.keys()
        assert "api_key" not in answer
    assert {k: v for k, v in info.items() if k not in ("live_requests", "scheduler")} == {
        k: v for k, v in legacy.items() if k not in ("live_requests", "scheduler")
    }


def test_model_info_is_sglangs_shape_under_both_names(workers: list[ServerProcess]) -> None:
    with client(workers[0]) as c:
        info, legacy = c.get("/model_info").json(), c.get("/get_model_info").json()
    assert (
        info
        == legacy
        == {
            "model_path": str(DEFAULT_TOKENIZER_DIR),
            "tokenizer_path": str(DEFAULT_TOKENIZER_DIR),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": True,  # the shipped tokenizer has the media placeholders
            "has_audio_understanding": True,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "served_model_name": DEFAULT_MODEL_NAME,
            "max_context_length": info["max_context_length"],
            "vocab_size": info["vocab_size"],
        }
    )
    with client(workers[0]) as c:
        v1 = c.get("/v1/models").json()["data"][0]
    assert v1["id"] == info["served_model_name"]


def test_an_embedding_server_is_not_generation(tmp_path: Path) -> None:
    srv = ServerProcess(
        tmp_path / "tmp", ["--mode", "embedding", "--served-model-name", "embedder"]
    ).wait_ready()
    try:
        with srv.client() as c:
            info, server = c.get("/model_info").json(), c.get("/get_server_info").json()
    finally:
        srv.stop()
    assert info["is_generation"] is False and server["is_generation"] is False
    assert info["served_model_name"] == server["served_model_name"] == "embedder"


def test_get_load_counts_running_and_waiting_requests(workers: list[ServerProcess]) -> None:
    srv = workers[0]  # one request at a time: the second waits
    assert wait_until(lambda: load(srv) == IDLE_LOAD, timeout=30)
    queued_prompt = list(range(100, 150))
    running = {**LONG_BODY, "rid": "load-running"}
    waiting = {
        "input_ids": queued_prompt,
        "sampling_params": {"max_new_tokens": 4},
        "rid": "load-waiting",
    }
    with long_requests(srv, running):
        assert wait_until(
            lambda: load(srv)["num_tokens"] > 0 and load(srv)["num_waiting_reqs"] == 0, timeout=60
        )
        with long_requests(srv, waiting):
            # The waiting prompt counts in full; the running request's KV comes with it.
            assert wait_until(lambda: load(srv)["num_tokens"] > len(queued_prompt), timeout=60)
            now = load(srv)
            assert (now["num_reqs"], now["num_waiting_reqs"]) == (2, 1), now
    assert wait_until(lambda: load(srv) == IDLE_LOAD, timeout=30), load(srv)


def test_flush_cache_drops_the_prefix_cache(workers: list[ServerProcess]) -> None:
    srv = workers[1]
    generate(srv, REPEATED)
    assert generate(srv, REPEATED)["cached_tokens"] > 0
    with client(srv) as c:
        resp = c.post("/flush_cache")
        assert resp.status_code == 200, resp.text
        assert (
            resp.json()["message"] == "Cache flushed."
            and resp.json()["flushed_tokens"]["device"] > 0
        )
        assert generate(srv, REPEATED)["cached_tokens"] == 0
        # GET does the same (SGLang takes both), and the scheduler reports the empty cache
        # at once, though it is idle.
        assert c.get("/flush_cache").status_code == 200
        assert wait_until(
            lambda: c.get("/server_info").json()["scheduler"]["cached_tokens_in_tree"] == 0,
            timeout=30,
        )
        assert c.post("/flush_cache", json={"all": True}).status_code == 400  # no such option


def test_flush_cache_is_refused_while_a_request_runs(workers: list[ServerProcess]) -> None:
    srv = workers[1]
    generate(srv, REPEATED)
    with long_requests(srv, {**LONG_BODY, "rid": "flush-blocker"}), client(srv) as c:
        assert wait_until(lambda: load(srv)["num_tokens"] > 0, timeout=60)
        resp = c.post("/flush_cache")
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["message"] == REFUSED + "#queue-req: 0, #running-req: 1"
        assert error["type"] == "invalid_request_error" and error["code"] == 400
        assert c.post("/abort_request", json={"rid": "flush-blocker"}).json() == {
            "aborted": "flush-blocker"
        }, "it ended first"
    assert generate(srv, REPEATED)["cached_tokens"] > 0, "a refused flush dropped the cache"


# --- through sglang-router -------------------------------------------------------------


@pytest.fixture(scope="module")
def sglang_router(
    workers: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SglangRouter]:
    log = tmp_path_factory.mktemp("sglang-router") / "router.log"
    router = SglangRouter(
        ["--worker-urls", *(w.url for w in workers)], log, api_key=API_KEY, log_level="debug"
    )
    try:
        # Registered: each worker's /server_info and /model_info read, its tokenizer loaded.
        registered = wait_until(
            lambda: (
                len([w for w in router.workers() if w["is_healthy"]]) == 2
                and router.output().count("Successfully registered tokenizer") >= 1
            ),
            timeout=120,
            interval=0.2,
        )
        assert registered, router.output()[-6000:]
        yield router
    finally:
        router.stop()


def test_router_registers_the_workers_with_their_model_and_tokenizer(
    sglang_router: SglangRouter, workers: list[ServerProcess]
) -> None:
    registered = {w["url"]: w for w in sglang_router.workers()}
    assert registered.keys() == {w.url for w in workers}
    for worker in registered.values():
        assert worker["model_id"] == DEFAULT_MODEL_NAME  # from /server_info's served_model_name
        assert worker["metadata"]["dp_size"] == "1" and worker["metadata"]["model_path"] == str(
            DEFAULT_TOKENIZER_DIR
        )
    log = sglang_router.output()
    # It loads the tokenizer from the model_path of /server_info: the shipped tokenizer's directory.
    assert (
        f"Successfully registered tokenizer for model {DEFAULT_MODEL_NAME} from "
        f"{DEFAULT_TOKENIZER_DIR}" in log
    )
    assert "HuggingFace" not in log and "returned 404" not in log, (
        "a worker endpoint was missing or the tokenizer was not local"
    )
    with sglang_router.client() as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [DEFAULT_MODEL_NAME]


def test_router_get_loads_shows_the_workers_loads(
    sglang_router: SglangRouter, workers: list[ServerProcess]
) -> None:
    def loads() -> dict[str, int]:
        with sglang_router.client() as c:
            return {w["worker"]: w["load"] for w in c.get("/get_loads").json()["workers"]}

    busy, idle = workers
    # -1 would mean the router could not read a worker's /get_load.
    assert wait_until(lambda: loads() == {busy.url: 0, idle.url: 0}, timeout=30), loads()
    with long_requests(busy, {**LONG_BODY, "rid": "router-load"}):
        assert wait_until(lambda: loads()[busy.url] > 0, timeout=60), loads()
        assert loads()[idle.url] == 0
    assert wait_until(lambda: loads() == {busy.url: 0, idle.url: 0}, timeout=30), loads()


def test_router_flush_cache_flushes_every_worker(
    sglang_router: SglangRouter, workers: list[ServerProcess]
) -> None:
    for srv in workers:
        generate(srv, REPEATED)
        assert generate(srv, REPEATED)["cached_tokens"] > 0
    with sglang_router.client() as c:
        # A worker that runs a request refuses, and the router says which one.
        with long_requests(workers[0], {**LONG_BODY, "rid": "router-flush"}):
            assert wait_until(lambda: load(workers[0])["num_tokens"] > 0, timeout=60)
            partial = c.post("/flush_cache")
            assert partial.status_code == 206, partial.text
            assert [f["worker"] for f in partial.json()["failed"]] == [workers[0].url]
        resp = c.post("/flush_cache")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert (
        body["status"] == "success" and body["workers_flushed"] == body["total_http_workers"] == 2
    ), body
    for srv in workers:
        assert generate(srv, REPEATED)["cached_tokens"] == 0
