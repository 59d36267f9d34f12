"""KV cache events and cache salts against a real server, read by a subscriber built from vLLM's
own event classes: blocks stored with vLLM's hashes and parent chain, nothing stored for a
shared prefix, evictions and a flush withdrawn, gapless sequence numbers, the replay socket
resending a missed range, and an index built only from the events predicting 200 requests'
cached tokens to the block; salts share cached KV only within one salt."""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cbor2
import msgspec
import openai
import pytest
import zmq

from tests.server_harness import ServerProcess, free_port, wait_until

BLOCK = 16
TOPIC = "kv@test"


# --- vLLM's event classes, mirrored field for field from vllm/distributed/kv_events.py
# (vLLM 0.32.0): what a KV-aware router built on vLLM decodes the stream with.


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def vllm_hashes(tokens: list[int], salt: str | None = None) -> list[int]:
    """vLLM's block hashes (sha256_cbor, NONE_HASH from PYTHONHASHSEED or its default seed,
    the salt an extra key of block 0), as its events carry them by default: the low 64 bits."""

    def sha(value: object) -> bytes:
        return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()

    # The server inherits this environment: NONE_HASH's seed is PYTHONHASHSEED when set.
    parent, out = sha(os.environ.get("PYTHONHASHSEED", "vllm-none-hash")), []
    for b in range(len(tokens) // BLOCK):
        extra = (("cache_salt", salt),) if b == 0 and salt is not None else None
        parent = sha((parent, tuple(tokens[b * BLOCK : (b + 1) * BLOCK]), extra))
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


class Subscriber:
    """A router's side: the PUB stream, gaps filled from the replay socket, and the index of
    stored blocks the events build."""

    def __init__(self, endpoint: str, replay: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.payloads: dict[int, bytes] = {}  # seq -> payload, as received
        self.applied = 0  # batches applied to the index, in seq order
        self.index: set[int] = set()
        self.stored: list[BlockStored] = []
        self.removed: list[BlockRemoved] = []
        self.cleared = 0
        self.replayed = 0

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out: list[tuple[int, bytes]] = []
            while True:
                assert dealer.poll(10_000), "the replay socket did not answer"
                _, seq, payload = dealer.recv_multipart()
                if seq == (-1).to_bytes(8, "big", signed=True):
                    return out
                out.append((int.from_bytes(seq, "big"), payload))
        finally:
            dealer.close(linger=0)

    def poll(self, timeout_ms: int = 100) -> bool:
        """Takes in what has arrived (waiting up to ``timeout_ms`` for the first); False, so
        that ``wait_until(lambda: events.poll() or ...)`` reads the condition."""
        while self.sub.poll(timeout_ms):
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == TOPIC.encode()
            seq = int.from_bytes(seq_bytes, "big")
            if seq > len(self.payloads):  # missed (a slow join): the replay socket resends
                for missed, data in self.replay(len(self.payloads)):
                    if missed < seq:
                        self.payloads.setdefault(missed, data)
                self.replayed += 1
            assert seq == len(self.payloads), f"sequence {seq} after {len(self.payloads)}"
            self.payloads[seq] = payload
            timeout_ms = 0
        while self.applied < len(self.payloads):
            self.apply(self.decoder.decode(self.payloads[self.applied]))
            self.applied += 1
        return False

    def apply(self, batch: KVEventBatch) -> None:
        assert batch.data_parallel_rank == 0
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert not self.index.intersection(event.block_hashes), "stored twice"
                self.index.update(int(h) for h in event.block_hashes)
                self.stored.append(event)
            elif isinstance(event, BlockRemoved):
                assert self.index.issuperset(event.block_hashes), "removed unannounced"
                self.index.difference_update(int(h) for h in event.block_hashes)
                self.removed.append(event)
            else:
                self.index.clear()
                self.cleared += 1

    def wait_for(self, block_hash: int) -> None:
        """Until the stream has announced ``block_hash`` (and everything before it)."""
        assert wait_until(lambda: self.poll() or block_hash in self.index, timeout=30), (
            f"block {block_hash} was never announced"
        )

    def predict(self, tokens: list[int], salt: str | None = None) -> int:
        """Cached tokens, whole blocks, from the index alone: the prompt's leading blocks it
        holds (the last prompt token is always computed)."""
        hits = 0
        for h in vllm_hashes(tokens, salt):
            if h not in self.index:
                break
            hits += 1
        return min(hits * BLOCK, (len(tokens) - 1) // BLOCK * BLOCK)


class Served:
    def __init__(self, server: ServerProcess, events: Subscriber) -> None:
        self.server, self.events = server, events
        self.http = server.client()

    def generate(self, ids: list[int], salt: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        }
        if salt is not None:
            body["cache_salt"] = salt
        answer = self.http.post("/generate", json=body)
        assert answer.status_code == 200, answer.text
        return answer.json()["meta_info"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    port, replay = free_port(), free_port()
    events_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": TOPIC,
    }
    root: Path = tmp_path_factory.mktemp("kv_events")
    args = ["--kv-events-config", json.dumps(events_config), "--max-total-tokens", "2048"]
    with ServerProcess(root / "server", args).wait_ready() as server:
        sub = Subscriber(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")
        try:
            yield Served(server, sub)
        finally:
            sub.ctx.destroy(linger=0)


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(n)]


def test_a_prompt_stores_its_blocks_and_a_shared_one_stores_nothing(served: Served) -> None:
    events = served.events
    first = prompt(random.Random(1), 40)
    assert served.generate(first)["cached_tokens"] == 0
    events.wait_for(vllm_hashes(first)[-1])
    stored = events.stored[-1]
    assert stored.block_hashes == vllm_hashes(first)  # 2 blocks, chained from NONE_HASH
    assert stored.parent_block_hash is None and stored.token_ids == first[:32]
    assert stored.block_size == BLOCK and stored.medium == "GPU"
    assert stored.extra_keys == [None, None] and stored.lora_name is None
    before = len(events.stored)
    again = first[:36] + prompt(random.Random(2), 3)  # shares 36 tokens: 2 whole blocks
    assert served.generate(again)["cached_tokens"] >= 32
    events.poll(300)
    assert len(events.stored) == before  # nothing new: no full block past the shared ones


def test_salts_share_cached_kv_only_within_one_salt(served: Served) -> None:
    events = served.events
    ids = prompt(random.Random(3), 50)
    assert served.generate(ids, salt="tenant-a")["cached_tokens"] == 0
    events.wait_for(vllm_hashes(ids, "tenant-a")[-1])
    assert events.stored[-1].extra_keys == [("tenant-a",), None, None]
    assert served.generate(ids, salt="tenant-b")["cached_tokens"] == 0
    assert served.generate(ids)["cached_tokens"] == 0
    assert served.generate(ids, salt="tenant-a")["cached_tokens"] == 49
    # The OpenAI routes take vLLM's field; an empty salt is refused, naming it.
    client = served.server.openai_client()
    model = client.models.list().data[0].id
    text = "tenancy " * 40
    for expected in (0, 1):
        done = client.completions.create(
            model=model, prompt=text, max_tokens=1, extra_body={"cache_salt": "tenant-c"}
        )
        assert done.usage is not None and done.usage.prompt_tokens_details is not None
        cached = done.usage.prompt_tokens_details.cached_tokens or 0
        assert (cached > 0) == bool(expected)
    # Chat and the Responses API take it too: their second request under a salt hits.
    messages = [{"role": "user", "content": "salted " * 40}]
    for expected in (0, 1):
        chat = client.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=1,
            extra_body={"cache_salt": "tenant-d"},
        )
        assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
        assert bool(chat.usage.prompt_tokens_details.cached_tokens) == bool(expected)
    for salt, hit in (("tenant-e", False), ("tenant-f", False), ("tenant-e", True)):
        answer = client.responses.create(
            model=model,
            input="respond " * 40,
            max_output_tokens=16,
            extra_body={"cache_salt": salt},
        )
        assert answer.usage is not None
        assert bool(answer.usage.input_tokens_details.cached_tokens) == hit
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.completions.create(
            model="m", prompt="x", max_tokens=1, extra_body={"cache_salt": ""}
        )


def test_an_index_built_from_events_predicts_cached_tokens(served: Served) -> None:
    """200 requests over shared prefixes in a 2048-token pool (so the tree evicts): before
    each, the index built only from the events predicts its cached tokens, to the block."""
    events, rng = served.events, random.Random(4)
    bases = [prompt(rng, 96) for _ in range(6)]
    removed_before, hits = len(events.removed), 0
    for _ in range(200):
        # A random tail of 18 or more tokens: even should its first token or two happen to
        # continue a cached prefix, 16 new ones remain, so each request stores a block (its
        # last full one), our fence.
        ids = rng.choice(bases)[: rng.randrange(0, 97)] + prompt(rng, rng.randrange(18, 40))
        predicted = events.predict(ids)
        meta = served.generate(ids)
        assert meta["cached_tokens"] // BLOCK * BLOCK == predicted, (len(ids), meta)
        hits += predicted > 0
        events.wait_for(vllm_hashes(ids)[-1])
    assert hits > 100  # most requests found a cached prefix: the prediction had work to do
    assert len(events.removed) > removed_before  # the pool was full: evictions were withdrawn


def test_flush_clears_and_the_stream_has_no_gap_the_replay_cannot_fill(served: Served) -> None:
    events = served.events
    ids = prompt(random.Random(5), 33)
    served.generate(ids)
    events.wait_for(vllm_hashes(ids)[-1])
    assert served.http.post("/flush_cache").status_code == 200
    assert wait_until(lambda: events.poll() or not events.index, timeout=30)
    assert events.cleared >= 1
    assert served.generate(ids)["cached_tokens"] == 0
    # Sequence numbers are gapless from 0 (poll asserts each), and the replay socket resends
    # any range exactly as it was published.
    events.poll(300)
    received = sorted(events.payloads)
    assert received == list(range(len(received)))
    middle = len(received) // 2
    assert events.replay(middle) == [(s, events.payloads[s]) for s in received[middle:]]


def test_a_malformed_replay_request_is_dropped_and_the_publisher_goes_on(served: Served) -> None:
    events = served.events
    dealer = events.ctx.socket(zmq.DEALER)
    dealer.connect(events.replay_endpoint)
    dealer.send_multipart([b"", b"not-a-seq"])
    dealer.close(linger=0)
    ids = prompt(random.Random(6), 20)
    served.generate(ids)
    events.wait_for(vllm_hashes(ids)[-1])
    assert events.replay(0)[0][0] == 0
