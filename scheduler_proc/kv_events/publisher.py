"""Publishes KV event batches as vLLM's ZeroMQ publisher does: a PUB socket sends
``[topic, seq, payload]`` (seq an 8-byte big-endian counter from 0, gapless), and a ROUTER
replay socket answers a request ``[b"", start_seq]`` with every kept batch from there,
``[b"", seq, payload]`` each, then ``[b"", -1, b""]``. The sockets live on their own
thread, fed by a bounded queue, so a slow subscriber never stalls a step.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import msgspec
import zmq

from pipeline.kv_events import KVEventBatch, KVEventsConfig

logger = logging.getLogger("tokenpipe.scheduler")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STOP = None  # the queue's last item


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address, ipc or inproc binds; any other address connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], config: KVEventsConfig) -> None:
        self._topic = config.topic.encode()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        # Made here so that a bad endpoint fails the start; used only by the thread after.
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if binds(config.endpoint):
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if config.replay_endpoint is not None:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        self.dropped = 0  # batches a full queue refused (the subscriber sees the gap in seq)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            logger.warning("KV event queue full: a batch of %d events dropped", len(batch.events))

    def close(self) -> None:
        """Sends what is queued, then closes the sockets."""
        self._queue.put(_STOP)
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    batch = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if batch is _STOP:
                    break
                payload = encoder.encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                seq += 1
        finally:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frame = self._replay.recv_multipart()
        if len(frame) != 3 or len(frame[2]) != 8:
            logger.warning("dropped a malformed KV event replay request (%d parts)", len(frame))
            return
        client, _, start = frame
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
