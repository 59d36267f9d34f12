"""The KV transfer wire between a prefill and a decode scheduler (PD disaggregation).

A decode scheduler sends ``KVFetch`` frames through one DEALER per prefill endpoint; the
prefill scheduler's ROUTER answers each with a multipart message: a ``KVTransferHeader``
frame, then (when ``ok``) the K and V tensors as two raw frames. Tensor bytes travel
as-is (no pickle, no msgpack copy of a large array): the header names their layout, and
the receiver checks every size before it reads a byte.

This module only moves bytes and tensors; who asks for what, and when, is
``scheduler_proc.pd.prefill`` and ``scheduler_proc.pd.decode``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from pipeline.io_struct import KVFetch, KVLayout, KVTransferHeader
from pipeline.sockets import FrameDecoder, RateLimitedWarning, make_encoder
from scheduler_proc.cache.kv_pool import KVPool

logger = logging.getLogger("tokenpipe.kv_transfer")

# A fetch names token ids only: bound what a peer may make the prefill side read.
_MAX_FETCH_BYTES = 16 << 20


def pool_layout(kv: KVPool) -> KVLayout:
    layers, _, heads, head_dim = kv.k.shape
    return KVLayout(
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype=str(kv.k.dtype).removeprefix("torch."),
    )


def gather_kv(kv: KVPool, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``slots`` as contiguous host tensors [layers, n, heads, head_dim]: a copy,
    so the slots can be reused while the bytes wait for their receiver."""
    index = slots.to(kv.k.device)
    return kv.k[:, index].contiguous().cpu(), kv.v[:, index].contiguous().cpu()


def scatter_kv(kv: KVPool, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Writes received K and V into ``slots`` of the pool."""
    index = slots.to(kv.k.device)
    kv.k[:, index] = k.to(kv.k.device)
    kv.v[:, index] = v.to(kv.v.device)


class KVTransferError(ValueError):
    """A transfer whose header and tensor frames do not agree."""


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    # Viewed as bytes so any dtype (bfloat16 included, which numpy lacks) goes out as-is.
    return t.reshape(-1).view(torch.uint8).numpy().data


def tensors_from_frames(
    header: KVTransferHeader, k_raw: bytes, v_raw: bytes, expected: KVLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V from a transfer's raw frames, checked against the receiver's own layout."""
    layout = header.layout
    if layout != expected:
        raise KVTransferError(
            f"the prefill server's KV layout {layout} differs from this server's {expected} "
            "(different models?)"
        )
    dtype = getattr(torch, expected.dtype)
    shape = (expected.num_layers, header.num_tokens, expected.num_kv_heads, expected.head_dim)
    size = shape[0] * shape[1] * shape[2] * shape[3] * torch.empty((), dtype=dtype).element_size()
    if header.num_tokens <= 0 or len(k_raw) != size or len(v_raw) != size:
        raise KVTransferError(
            f"KV frames of {len(k_raw)} and {len(v_raw)} bytes do not hold "
            f"{header.num_tokens} tokens ({size} bytes each)"
        )
    # bytearray: a writable copy, which torch.frombuffer wants.
    k = torch.frombuffer(bytearray(k_raw), dtype=torch.uint8).view(dtype).reshape(shape)
    v = torch.frombuffer(bytearray(v_raw), dtype=torch.uint8).view(dtype).reshape(shape)
    return k, v


class KVFetchServer:
    """Prefill side: a ROUTER bound where decode servers fetch KV."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str) -> None:
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, _MAX_FETCH_BYTES)
        # A reply to a decode server that went away is dropped, never an error here.
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.socket.bind(endpoint)
        self.endpoint = endpoint
        self._decoder: FrameDecoder[KVFetch] = FrameDecoder(KVFetch, logger, "KV fetch")
        self._shape = RateLimitedWarning(logger)
        self._encoder = make_encoder()

    def receive(self) -> list[tuple[bytes, KVFetch]]:
        """Every fetch that has arrived, with the identity to answer."""
        got: list[tuple[bytes, KVFetch]] = []
        while True:
            try:
                parts = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return got
            if len(parts) != 2:  # the peer's identity, then its one frame
                self._shape.warn("dropped a KV fetch of %d frames (expected 1)", len(parts) - 1)
                continue
            fetch = self._decoder.decode(parts[1])
            if fetch is not None:
                got.append((parts[0], fetch))

    def send(
        self,
        identity: bytes,
        header: KVTransferHeader,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
    ) -> None:
        frames: list[bytes | memoryview] = [identity, self._encoder.encode(header)]
        if k is not None and v is not None:
            frames += [_tensor_bytes(k), _tensor_bytes(v)]
        try:
            self.socket.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:  # the decode server is not reading: it times the request out
            logger.warning(
                "could not send KV for room %d: the decode server's queue is full", header.room
            )

    def close(self) -> None:
        self.socket.close(linger=0)


_PEER_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
# Endpoints come from requests: bound the sockets (and file descriptors) they can open.
MAX_PREFILL_PEERS = 64
# A dead peer is retried with backoff up to this, not every 100 ms; short enough that a
# restarted peer is reconnected well within the decode side's connect grace.
_RECONNECT_MAX_MS = 1000


class KVFetchClient:
    """Decode side: one DEALER per prefill endpoint, each registered with the scheduler
    loop's poller so an arriving transfer wakes it.

    ZeroMQ connects and reconnects silently, so each DEALER also has a monitor: a dropped
    connection is reported by ``lost_peers``, and ``down_since`` tells how long a peer has
    refused connections, so the decode side need not wait for its timeout to find out."""

    def __init__(self, ctx: zmq.Context[Any], poller: zmq.Poller | None = None) -> None:
        self._ctx = ctx
        self._poller = poller
        self._sockets: dict[str, zmq.Socket[Any]] = {}
        self._monitors: dict[str, zmq.Socket[Any]] = {}
        self._connected: dict[str, bool] = {}
        self._down_since: dict[
            str, float
        ] = {}  # endpoints refusing or dropping connections, since when
        self._decoder: FrameDecoder[KVTransferHeader] = FrameDecoder(
            KVTransferHeader, logger, "KV transfer header"
        )
        self._shape = RateLimitedWarning(logger)
        self._encoder = make_encoder()

    def send(self, endpoint: str, fetch: KVFetch) -> None:
        sock = self._sockets.get(endpoint)
        if sock is None:
            if len(self._sockets) >= MAX_PREFILL_PEERS:
                raise KVTransferError(
                    f"this decode server already fetches from {MAX_PREFILL_PEERS} prefill "
                    "endpoints, its limit"
                )
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, _RECONNECT_MAX_MS)
            monitor = sock.get_monitor_socket(_PEER_EVENTS)
            try:
                sock.connect(endpoint)  # asynchronous: the monitor tells how it goes
            except zmq.ZMQError as exc:
                sock.disable_monitor()
                monitor.close(linger=0)
                sock.close(linger=0)
                raise KVTransferError(f"cannot connect to {endpoint}: {exc}") from None
            self._sockets[endpoint] = sock
            self._monitors[endpoint] = monitor
            self._connected[endpoint] = False
            if self._poller is not None:
                self._poller.register(sock, zmq.POLLIN)
                self._poller.register(monitor, zmq.POLLIN)
        try:
            sock.send(self._encoder.encode(fetch), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("could not queue a KV fetch for room %d to %s", fetch.room, endpoint)

    def receive(self) -> list[tuple[str, KVTransferHeader, list[bytes]]]:
        """Every transfer that has arrived: (endpoint, header, the raw frames after it)."""
        got: list[tuple[str, KVTransferHeader, list[bytes]]] = []
        for endpoint, sock in self._sockets.items():
            while True:
                try:
                    parts = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                header = self._decoder.decode(parts[0])
                if header is None:
                    continue
                got.append((endpoint, header, parts[1:]))
        return got

    def lost_peers(self, now: float) -> set[str]:
        """Takes the connection events: returns the endpoints whose connection dropped
        since the last call (a fetch out to one is lost with it: a restarted peer no longer
        has what it was asked for), and updates ``down_since``."""
        lost: set[str] = set()
        for endpoint, monitor in self._monitors.items():
            while True:
                try:
                    event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
                except zmq.Again:
                    break
                if event == zmq.EVENT_CONNECTED:
                    self._connected[endpoint] = True
                    self._down_since.pop(endpoint, None)
                elif event == zmq.EVENT_DISCONNECTED:
                    self._connected[endpoint] = False
                    self._down_since.setdefault(endpoint, now)
                    lost.add(endpoint)
                elif event == zmq.EVENT_CONNECT_RETRIED and not self._connected[endpoint]:
                    self._down_since.setdefault(endpoint, now)
        return lost

    def down_since(self, endpoint: str) -> float | None:
        """When the peer started refusing connections (None: connected, or not known yet)."""
        return self._down_since.get(endpoint)

    def close(self) -> None:
        for endpoint, sock in self._sockets.items():
            sock.disable_monitor()
            self._monitors[endpoint].close(linger=0)
            sock.close(linger=0)
        self._sockets.clear()
        self._monitors.clear()
