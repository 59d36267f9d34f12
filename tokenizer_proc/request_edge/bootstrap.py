"""PD disaggregation's bootstrap fields, as the native and OpenAI bodies carry them: the room
shared by a request's prefill and decode halves, and the prefill server's KV endpoint."""

from __future__ import annotations

import re
from typing import Annotated, TypeVar

import msgspec
from msgspec import Meta

from tokenizer_proc.request_edge.errors import RequestValidationError

Room = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Port = Annotated[int, Meta(ge=1, le=65535)]
# tcp://host:port or ipc:///absolute/path: anything else would make ZeroMQ refuse it later.
_ENDPOINT = re.compile(
    r"tcp://[A-Za-z0-9.\-]+:[0-9]{1,5}|tcp://\[[0-9A-Fa-f:.]+\]:[0-9]{1,5}|ipc:///[^\s\x00]+"
)


class Bootstrap(msgspec.Struct, frozen=True):
    """PD disaggregation: the room shared by a request's prefill and decode halves, and the
    prefill server's KV endpoint the decode server fetches from."""

    room: int
    endpoint: str


# SGLang's router sends each bootstrap field as a scalar, or as a list with one entry per
# prompt of a batch; tokenpipe's requests carry one prompt, so a list must have one entry.
RoomField = Room | list[Room]
HostField = str | list[str]
PortField = Port | list[Port]


_T = TypeVar("_T")


def _single(value: _T | list[_T] | None, name: str) -> _T | None:
    if not isinstance(value, list):
        return value
    if len(value) != 1:
        raise RequestValidationError(
            f"{name} has {len(value)} entries; a request here has one prompt, so give one", name
        )
    return value[0]


def bootstrap_of(
    room: RoomField | None, endpoint: str | None, host: HostField | None, port: PortField | None
) -> Bootstrap | None:
    """The bootstrap fields of a request body (SGLang's ``bootstrap_host``/``bootstrap_port``,
    or a ZeroMQ ``bootstrap_endpoint``), or None when it has none."""
    room = _single(room, "bootstrap_room")
    host = _single(host, "bootstrap_host")
    port = _single(port, "bootstrap_port")
    if room is None and endpoint is None and host is None and port is None:
        return None
    if room is None:
        raise RequestValidationError(
            "bootstrap_room is required with the other bootstrap fields", "bootstrap_room"
        )
    if endpoint is None:
        if host is None:
            raise RequestValidationError(
                "give bootstrap_endpoint, or bootstrap_host (and bootstrap_port)",
                "bootstrap_endpoint",
            )
        shown_host = f"[{host}]" if ":" in host else host
        endpoint = f"tcp://{shown_host}:{port if port is not None else 8998}"
    if len(endpoint) > 512 or _ENDPOINT.fullmatch(endpoint) is None:
        raise RequestValidationError(
            f"bootstrap endpoint {endpoint[:100]!r} is not tcp://host:port or ipc:///path",
            "bootstrap_endpoint",
        )
    return Bootstrap(room=room, endpoint=endpoint)
