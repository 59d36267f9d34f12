"""A scheduler's KV cache events, from its radix tree to subscribers: ``attach_kv_events``
puts a ``BlockEvents`` on the tree when ``--kv-events-config`` enables them, and the
scheduler loop publishes what each iteration changed as one batch (``after_step``)."""

from __future__ import annotations

from typing import Any

import zmq

from pipeline.config import ServerConfig
from pipeline.kv_events import parse_kv_events_config
from scheduler_proc.cache.radix_cache import RadixCache
from scheduler_proc.kv_events.block_events import BlockEvents
from scheduler_proc.kv_events.block_hashes import BlockHasher
from scheduler_proc.kv_events.publisher import ZmqEventPublisher


class KvEventStream:
    def __init__(self, events: BlockEvents, publisher: ZmqEventPublisher) -> None:
        self.events = events
        self.publisher = publisher

    def after_step(self) -> None:
        batch = self.events.take()
        if batch is not None:
            self.publisher.publish(batch)

    def close(self) -> None:
        self.after_step()
        self.publisher.close()


class NoKvEvents:
    """KV cache events off: nothing watches the tree."""

    def after_step(self) -> None:
        pass

    def close(self) -> None:
        pass


def attach_kv_events(
    config: ServerConfig, cache: RadixCache, ctx: zmq.Context[Any]
) -> KvEventStream | NoKvEvents:
    if config.kv_events_config is None:
        return NoKvEvents()
    events_config = parse_kv_events_config(config.kv_events_config)
    if not events_config.publishes:
        return NoKvEvents()
    events = BlockEvents(BlockHasher(config.kv_events_block_size, config.python_hash_seed))
    cache.events = events
    return KvEventStream(events, ZmqEventPublisher(ctx, events_config))
