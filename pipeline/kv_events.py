"""KV cache events as vLLM publishes them, for KV-aware routers (docs/design/tenancy.md): the
messages, field for field as vLLM 0.32 declares them (so a subscriber built from vLLM's
classes decodes ours), and ``--kv-events-config``, vLLM's JSON. A ZeroMQ PUB socket sends
``[topic, seq, payload]``, the payload a msgpack ``KVEventBatch``; block hashes travel as
vLLM's default external hashes, the low 64 bits of each sha256 digest as an integer.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

# The media vLLM names: the device tier (whatever the device), the host tier, storage.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events: each encodes as a map tagged ``type`` with its class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # One entry per block: the block's extra hash keys, untagged (the cache salt on a
    # prefix's first block), or None.
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


KVCacheEventKind = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVCacheEventKind]


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``--kv-events-config``, vLLM's fields and defaults."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None  # None: zmq when events are enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """The config a ``--kv-events-config`` value gives; ValueError naming what is wrong."""
    try:
        config = msgspec.json.decode(text, type=KVEventsConfig)
    except msgspec.DecodeError as exc:
        raise ValueError(f"--kv-events-config: {exc}") from exc
    if config.buffer_steps < 1 or config.hwm < 0 or config.max_queue_size < 1:
        raise ValueError(
            "--kv-events-config: buffer_steps and max_queue_size must be positive, hwm 0 or more"
        )
    return config
