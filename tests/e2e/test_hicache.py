"""HiCache: the host and storage tiers under the device KV pool.

In process: the radix tree with real host and file tiers keeps every token's K/V exact
through any number of moves down and back; the scheduler serves prefixes evicted from the
device back from the host and from storage, with the hits counted per tier and the same
greedy tokens as without any cache; attach and detach change every running request's
keys through the one setter. End to end: the same through a real server, including
attach and detach while a stream runs, and bad attaches.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pipeline.config import ServerConfig
from pipeline.control_frames import HiCacheStorageControl
from pipeline.io_struct import CachedTokensDetails
from scheduler_proc.cache.hicache import HiCache
from scheduler_proc.cache.kv_storage import FileStorage
from scheduler_proc.cache.kv_pool import KVPool
from scheduler_proc.main import build_scheduler
from scheduler_proc.cache.radix_cache import RadixCache
from scheduler_proc.scheduler import Scheduler
from tests.server_harness import ServerProcess, wait_until
from tests.unit.test_scheduler_steps import run_to_end, submit

PROMPTS = [[(13 * i + 5 + 97 * j) % 4000 + 50 for i in range(100)] for j in range(6)]
SUFFIX = [7, 8]


def hicache_scheduler(host: int, storage: Path | None = None, pool: int = 256) -> Scheduler:
    return build_scheduler(
        ServerConfig(
            max_total_tokens=pool,
            chunked_prefill_size=64,
            torch_threads=1,
            hicache_host_tokens=host,
            hicache_storage_dir=str(storage) if storage is not None else None,
        )
    )


def assert_no_leak(s: Scheduler) -> None:
    assert s.kv.num_used == s.cache.total_size, "a request's KV slots outlived it"
    assert s.cache.protected_size == 0 and not s.live
    assert s.hicache is not None
    s.hicache.check_invariants()  # includes: host pool slots used == host nodes' tokens


def serve_one(
    s: Scheduler, req_id: int, ids: list[int], max_new: int = 4
) -> tuple[list[int], object]:
    submit(s, req_id, ids, max_new=max_new)
    req = s.live[req_id]
    out, _ = run_to_end(s)
    return out[req_id], req.stats


@pytest.fixture(scope="module")
def uncached_tokens() -> list[int]:
    """Greedy tokens of the probe prompt on a fresh scheduler: nothing cached anywhere."""
    fresh = build_scheduler(
        ServerConfig(max_total_tokens=4096, chunked_prefill_size=64, torch_threads=1)
    )
    tokens, stats = serve_one(fresh, 1, PROMPTS[0] + SUFFIX)
    assert stats.cached_tokens == 0  # type: ignore[attr-defined]
    return tokens


# --- the scheduler, in process ---------------------------------------------------------


def test_prefix_evicted_from_device_is_served_from_host(uncached_tokens: list[int]) -> None:
    s = hicache_scheduler(host=512)
    for j in range(3):  # 3 x 103 tokens in a 256-token pool: the first prefix moves down
        serve_one(s, j + 1, PROMPTS[j])
    assert s.hicache is not None and s.hicache.tier_sizes()["host"] >= 100
    tokens, stats = serve_one(s, 10, PROMPTS[0] + SUFFIX)
    assert stats.cached_tokens == 100  # type: ignore[attr-defined]
    assert stats.cached_tokens_details == CachedTokensDetails(  # type: ignore[attr-defined]
        device=0, host=100
    )
    assert stats.time_stats.storage_prefetch_wait == 0.0  # type: ignore[attr-defined]
    assert tokens == uncached_tokens
    assert_no_leak(s)
    # The prefix is on the device now: the next hit is a device hit.
    _, again = serve_one(s, 11, PROMPTS[0] + [9])
    assert again.cached_tokens_details == CachedTokensDetails(  # type: ignore[attr-defined]
        device=100, host=0
    )
    assert_no_leak(s)


def test_prefix_evicted_from_host_is_served_from_storage(
    tmp_path: Path, uncached_tokens: list[int]
) -> None:
    s = hicache_scheduler(host=128, storage=tmp_path)
    for j in range(4):  # the host tier holds one prefix: the first one goes on to storage
        serve_one(s, j + 1, PROMPTS[j])
    assert s.hicache is not None and s.hicache.tier_sizes()["storage"] >= 100
    assert any(p.suffix == ".kv" for p in tmp_path.iterdir())
    tokens, stats = serve_one(s, 10, PROMPTS[0] + SUFFIX)
    assert stats.cached_tokens == 100  # type: ignore[attr-defined]
    assert stats.cached_tokens_details == CachedTokensDetails(
        device=0, host=0, storage=100, storage_backend="file"
    )  # type: ignore[attr-defined]
    assert stats.time_stats.storage_prefetch_wait > 0  # type: ignore[attr-defined]
    assert tokens == uncached_tokens
    assert_no_leak(s)


def test_unreadable_storage_file_is_a_miss(tmp_path: Path, uncached_tokens: list[int]) -> None:
    s = hicache_scheduler(host=128, storage=tmp_path)
    for j in range(4):
        serve_one(s, j + 1, PROMPTS[j])
    for p in tmp_path.iterdir():
        p.write_bytes(b"not a tensor file")
    tokens, stats = serve_one(s, 10, PROMPTS[0] + SUFFIX)
    assert stats.cached_tokens == 0 and tokens == uncached_tokens  # type: ignore[attr-defined]
    assert stats.cached_tokens_details == CachedTokensDetails(
        device=0, host=0, storage=0, storage_backend="file"
    )  # type: ignore[attr-defined]
    assert_no_leak(s)


def test_attach_and_detach_change_running_requests_keys(tmp_path: Path) -> None:
    s = hicache_scheduler(host=128, pool=512)
    submit(s, 1, PROMPTS[0], max_new=40)
    s.step()
    req = s.live[1]
    req.take_request_stats_due()  # the first row went out
    assert req.stats.cached_tokens_details is None

    bad = s.storage_control(
        HiCacheStorageControl(
            control_id=1, attach=True, backend="file", dir=str(tmp_path / "missing")
        )
    )
    assert (
        not bad.ok and bad.param == "dir" and "does not exist" in bad.error and bad.backend is None
    )
    bad = s.storage_control(
        HiCacheStorageControl(control_id=2, attach=True, backend="nfs", dir=str(tmp_path))
    )
    assert not bad.ok and bad.param == "backend" and "'nfs'" in bad.error
    assert req.take_request_stats_due() is None, "a failed attach changed nothing"

    ok = s.storage_control(
        HiCacheStorageControl(control_id=3, attach=True, backend="file", dir=str(tmp_path))
    )
    assert ok.ok and (ok.control_id, ok.backend, ok.dir) == (3, "file", str(tmp_path))
    stats = req.take_request_stats_due()
    assert stats is not None, "the next row carries the new keys"
    assert stats.cached_tokens_details == CachedTokensDetails(
        device=0, host=0, storage=0, storage_backend="file"
    )
    s.step()
    assert req.take_request_stats_due() is None

    other = s.storage_control(
        HiCacheStorageControl(control_id=4, attach=True, backend="file", dir="/")
    )
    assert not other.ok and "already attached" in other.error

    gone = s.storage_control(HiCacheStorageControl(control_id=5, attach=False))
    assert gone.ok and gone.backend is None
    stats = req.take_request_stats_due()
    assert stats is not None and stats.cached_tokens_details is None
    run_to_end(s)
    assert_no_leak(s)


def test_detach_drops_stored_prefixes_and_reattach_reuses_files(tmp_path: Path) -> None:
    s = hicache_scheduler(host=128, storage=tmp_path)
    for j in range(4):
        serve_one(s, j + 1, PROMPTS[j])
    assert s.hicache is not None
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files and s.hicache.tier_sizes()["storage"] > 0
    s.storage_control(HiCacheStorageControl(control_id=1, attach=False))
    assert (
        s.hicache.tier_sizes()["storage"] == 0
        and sorted(p.name for p in tmp_path.iterdir()) == files
    )
    assert_no_leak(s)
    # Without storage a full host tier drops what it evicts.
    for j in range(4, 6):
        serve_one(s, j + 1, PROMPTS[j])
    assert s.hicache.tier_sizes()["storage"] == 0
    assert_no_leak(s)
    s.storage_control(
        HiCacheStorageControl(control_id=2, attach=True, backend="file", dir=str(tmp_path))
    )
    storage = s.hicache.storage
    assert isinstance(storage, FileStorage) and set(storage.index) >= {f[:-3] for f in files}


# --- the radix tree with lower tiers, no model -----------------------------------------


def test_random_moves_keep_every_tokens_kv_exact(tmp_path: Path) -> None:
    """Random inserts, matches (bringing lower-tier hits back exactly as the scheduler
    does), locks and evictions over a 48-token device pool, a 20-token host pool and a
    file store. Each token's K/V is a function of its prefix; after every operation every
    device-resident token still holds its own K/V, and the tiers' invariants hold."""
    rng = random.Random(7)
    kv = KVPool(2, 48, 1, 3, torch.float32, "cpu", debug=True)
    hicache = HiCache(kv, 20, namespace="test")
    cache = RadixCache(kv, lower=hicache)
    hicache.bind(cache)
    hicache.attach_storage("file", str(tmp_path))

    def kv_of(prefix: list[int]) -> torch.Tensor:
        h = hash(tuple(prefix)) % 100_003
        return torch.tensor([h, len(prefix), prefix[-1]], dtype=torch.float32)

    def check_device_kv() -> None:
        stack = [(c, []) for c in cache.root.children.values()]
        while stack:
            node, prefix = stack.pop()
            p = prefix + node.key.tolist()
            if node.value is not None:
                for i, slot in enumerate(node.value.tolist()):
                    want = kv_of(p[: len(prefix) + i + 1])
                    assert torch.equal(kv.k[:, slot, 0], want.expand(2, 3)), (
                        "device K/V of a token changed"
                    )
                    assert torch.equal(kv.v[:, slot, 0], -want.expand(2, 3))
            stack.extend((c, p) for c in node.children.values())

    bases = [[rng.randrange(6) for _ in range(14)] for _ in range(5)]
    locked: list = []
    for _ in range(300):
        ids = rng.choice(bases)[: rng.randrange(1, 15)] + [
            rng.randrange(6) for _ in range(rng.randrange(0, 4))
        ]
        op = rng.random()
        if op < 0.6:
            slots, node = cache.match_prefix(ids)
            cache.inc_lock(node)
            lower = hicache.match_below(node, ids, len(slots))
            if kv.num_free + cache.evictable_size < len(ids) - len(slots):
                cache.dec_lock(node)
                continue
            fetched = hicache.fetch(lower)
            rest = len(ids) - len(slots) - fetched.num_tokens
            if kv.num_free < fetched.num_tokens + rest:
                cache.evict(fetched.num_tokens + rest - kv.num_free)
            new = kv.alloc(fetched.num_tokens + rest)
            assert new is not None
            if fetched.num_tokens:
                deepest = hicache.install(fetched, new[: fetched.num_tokens])
                cache.inc_lock(deepest)
                cache.dec_lock(node)
                node = deepest
            held = torch.cat((slots, new))
            for i in range(len(slots) + fetched.num_tokens, len(ids)):  # "compute" the rest
                want = kv_of(ids[: i + 1])
                kv.k[:, int(held[i]), 0] = want
                kv.v[:, int(held[i]), 0] = -want
            for i in range(len(ids)):  # what the model would read: every token's own K/V
                assert torch.equal(kv.k[:, int(held[i]), 0], kv_of(ids[: i + 1]).expand(2, 3))
            cache.insert(ids, held)
            if rng.random() < 0.3 and len(locked) < 3:
                locked.append(node)
            else:
                cache.dec_lock(node)
        elif op < 0.75 and locked:
            cache.dec_lock(locked.pop(rng.randrange(len(locked))))
        elif op < 0.85:
            cache.evict(rng.randrange(1, 30))
        elif op < 0.9:
            if hicache.storage.attached:
                hicache.detach_storage()
            else:
                hicache.attach_storage("file", str(tmp_path))
        hicache.check_invariants()
        assert kv.num_used == cache.total_size
        check_device_kv()
    assert (
        min(
            hicache.tokens_demoted,
            hicache.tokens_written,
            hicache.tokens_loaded_host,
            hicache.tokens_loaded_storage,
        )
        > 0
    ), vars(hicache)
    for node in locked:
        cache.dec_lock(node)
    cache.reset()
    hicache.check_invariants()
    assert kv.num_used == 0


# --- end to end ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hicache_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServerProcess, Path]]:
    storage = tmp_path_factory.mktemp("hicache-storage")
    srv = ServerProcess(
        tmp_path_factory.mktemp("hicache-server") / "tmp",
        [
            "--max-total-tokens",
            "512",
            "--chunked-prefill-size",
            "64",
            "--hicache-host-tokens",
            "256",
            "--hicache-storage-dir",
            str(storage),
        ],
    ).wait_ready()
    yield srv, storage
    srv.stop()


def test_prefix_pushed_out_of_device_and_host_comes_back_from_storage(
    hicache_server: tuple[ServerProcess, Path],
) -> None:
    srv, storage = hicache_server
    sampling = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    prompts = [[(31 * i + 17 * j) % 3000 + 300 for i in range(150)] for j in range(7)]
    with srv.client() as c:
        first = c.post(
            "/generate", json={"input_ids": prompts[0], "sampling_params": sampling}
        ).json()
        assert first["meta_info"]["cached_tokens_details"] == {
            "device": 0,
            "host": 0,
            "storage": 0,
            "storage_backend": "file",
        }
        for p in prompts[1:]:  # 3 prompts fit the device pool, 1 the host tier
            c.post(
                "/generate", json={"input_ids": p, "sampling_params": sampling}
            ).raise_for_status()
        back = c.post(
            "/generate", json={"input_ids": prompts[0] + [5, 6], "sampling_params": sampling}
        ).json()
        info = c.get("/server_info").json()["scheduler"]
    meta = back["meta_info"]
    assert meta["cached_tokens_details"] == {
        "device": 0,
        "host": 0,
        "storage": 150,
        "storage_backend": "file",
    }
    assert meta["cached_tokens"] == 150 and meta["storage_prefetch_wait"] > 0
    assert any(p.suffix == ".kv" for p in storage.iterdir())
    assert info["hicache_host_capacity"] == 256 and info["hicache_storage_backend"] == "file"


def test_attach_and_detach_mid_stream_change_the_next_rows_keys(
    hicache_server: tuple[ServerProcess, Path],
) -> None:
    srv, storage = hicache_server
    events: list[dict] = []  # type: ignore[type-arg]
    body = {
        "input_ids": [4000 - i for i in range(12)],
        "stream": True,
        "sampling_params": {"max_new_tokens": 420, "temperature": 0, "ignore_eos": True},
    }

    def read_stream() -> None:
        with srv.client() as c, c.stream("POST", "/generate", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:])["meta_info"])

    with srv.client() as c:
        assert c.post("/hicache/storage/detach").json() == {
            "attached": False,
            "backend": None,
            "dir": None,
        }
        reader = threading.Thread(target=read_stream)
        reader.start()
        assert wait_until(lambda: len(events) >= 3, 60)
        before_attach = len(events)
        attached = c.post("/hicache/storage/attach", json={"backend": "file", "dir": str(storage)})
        assert attached.status_code == 200, attached.text
        assert attached.json() == {"attached": True, "backend": "file", "dir": str(storage)}
        after_attach = len(events)
        assert wait_until(lambda: len(events) >= after_attach + 5, 60)
        before_detach = len(events)
        assert c.post("/hicache/storage/detach", json={}).json()["attached"] is False
        after_detach = len(events)
        reader.join(120)
    assert events[-1]["finish_reason"] == {"type": "length", "length": 420}
    assert after_detach + 5 < len(events), "the stream should outlast the detach"

    keyed = ["storage" in (m["cached_tokens_details"] or {}) for m in events]
    first_on = keyed.index(True)
    last_on = len(keyed) - 1 - keyed[::-1].index(True)
    # Off, then on from one row on, then off again from one row on: each change shows on
    # the row after it and stays.
    assert (
        not any(keyed[:first_on])
        and all(keyed[first_on : last_on + 1])
        and not any(keyed[last_on + 1 :])
    )
    # Rows the server sent before the answer may still be on their way when it arrives.
    in_flight = 3
    assert before_attach <= first_on <= after_attach + in_flight, (
        before_attach,
        first_on,
        after_attach,
    )
    assert before_detach <= last_on + 1 <= after_detach + in_flight, (
        before_detach,
        last_on,
        after_detach,
    )
    assert events[first_on]["cached_tokens_details"] == {
        "device": 0,
        "host": 0,
        "storage": 0,
        "storage_backend": "file",
    }
    assert events[-1]["cached_tokens_details"] is None


def test_bad_attach_is_400(hicache_server: tuple[ServerProcess, Path], tmp_path: Path) -> None:
    srv, storage = hicache_server
    with srv.client() as c:
        c.post("/hicache/storage/detach").raise_for_status()
        missing = c.post(
            "/hicache/storage/attach", json={"backend": "file", "dir": str(tmp_path / "nope")}
        )
        unknown = c.post(
            "/hicache/storage/attach", json={"backend": "mooncake", "dir": str(storage)}
        )
        relative = c.post(
            "/hicache/storage/attach", json={"backend": "file", "dir": "relative/dir"}
        )
        a_file = tmp_path / "file"
        a_file.write_text("x")
        not_dir = c.post("/hicache/storage/attach", json={"backend": "file", "dir": str(a_file)})
        extra = c.post(
            "/hicache/storage/attach", json={"backend": "file", "dir": str(storage), "size": 1}
        )
        no_body = c.post("/hicache/storage/attach")
        ok = c.post("/hicache/storage/attach", json={"backend": "file", "dir": str(storage)})
        again = c.post("/hicache/storage/attach", json={"backend": "file", "dir": str(storage)})
        other = c.post("/hicache/storage/attach", json={"backend": "file", "dir": str(tmp_path)})
    assert missing.status_code == 400 and "does not exist" in missing.json()["error"]["message"]
    assert missing.json()["error"]["param"] == "dir"
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "backend"
    assert (
        "'mooncake'" in unknown.json()["error"]["message"]
        and "file" in unknown.json()["error"]["message"]
    )
    assert relative.status_code == 400 and "absolute" in relative.json()["error"]["message"]
    assert not_dir.status_code == 400 and "not a directory" in not_dir.json()["error"]["message"]
    assert extra.status_code == 400 and extra.json()["error"]["param"] == "size"
    assert no_body.status_code == 400
    assert (
        ok.status_code == 200 and again.status_code == 200
    )  # attaching the attached one is a no-op
    assert other.status_code == 400 and "already attached" in other.json()["error"]["message"]


def test_attach_without_hicache_is_400(server: ServerProcess, tmp_path: Path) -> None:
    with server.client() as c:
        resp = c.post("/hicache/storage/attach", json={"backend": "file", "dir": str(tmp_path)})
    assert resp.status_code == 400 and "--hicache-host-tokens" in resp.json()["error"]["message"]


def test_hicache_server_log_has_no_tracebacks(hicache_server: tuple[ServerProcess, Path]) -> None:
    assert "Traceback" not in hicache_server[0].output()


def test_bad_storage_dir_flag_is_refused(tmp_path: Path) -> None:
    srv = ServerProcess(
        tmp_path / "tmp",
        ["--hicache-host-tokens", "64", "--hicache-storage-dir", str(tmp_path / "missing")],
    )
    assert wait_until(lambda: srv.proc.poll() is not None, 60), "serve should refuse the flag"
    srv.stop()
    assert srv.proc.returncode == 2 and "does not exist" in srv.output()
    without_host = ServerProcess(tmp_path / "tmp2", ["--hicache-storage-dir", str(tmp_path)])
    assert wait_until(lambda: without_host.proc.poll() is not None, 60)
    without_host.stop()
    assert without_host.proc.returncode == 2 and "--hicache-host-tokens" in without_host.output()


def test_retraction_under_pressure_with_hicache_keeps_tokens(tmp_path: Path) -> None:
    """Many requests with shared prefixes in a small pool: retractions, evictions down
    both tiers and hits back from both, and the same greedy tokens as without HiCache."""

    def run(s: Scheduler) -> dict[int, list[int]]:
        for i in range(8):
            submit(s, i + 1, [100 + i % 3] * 20 + PROMPTS[i % 2][:30], max_new=40)
        out, _ = run_to_end(s)
        for i in range(8, 12):  # later arrivals hit what the earlier ones left in the tiers
            submit(s, i + 1, [100 + i % 3] * 20 + PROMPTS[i % 2][:30], max_new=8)
        out.update(run_to_end(s)[0])
        return out

    plain = build_scheduler(
        ServerConfig(max_total_tokens=400, chunked_prefill_size=64, torch_threads=1)
    )
    s = hicache_scheduler(host=64, storage=tmp_path, pool=400)
    want, got = run(plain), run(s)
    assert s.num_retracted_total > 0
    h = s.hicache
    assert (
        h is not None
        and min(h.tokens_demoted, h.tokens_written, h.tokens_loaded_host + h.tokens_loaded_storage)
        > 0
    ), vars(h)
    assert got == want
    assert_no_leak(s)
