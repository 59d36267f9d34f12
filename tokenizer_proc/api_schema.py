"""Typed request bodies of the native API. Decoding with msgspec is the validation: a
wrong type, an unknown key or a value out of range fails with a message that names the
field (``... - at `$.sampling_params.max_new_tokens```)."""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from pipeline.io_struct import SamplingParams

NonNegInt = Annotated[int, Meta(ge=0)]
PositiveInt = Annotated[int, Meta(ge=1)]
TokenId = Annotated[int, Meta(ge=0)]


class RequestValidationError(ValueError):
    """A request the server refuses with 400; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class GenerateSamplingParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    max_new_tokens: PositiveInt = 128
    min_new_tokens: NonNegInt = 0
    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = -1
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    stream_interval: PositiveInt | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    def to_wire(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stop):
            raise RequestValidationError("sampling_params.stop must not contain an empty string", "sampling_params.stop")
        if self.top_k == 0:
            raise RequestValidationError("sampling_params.top_k must be -1 (off) or at least 1", "sampling_params.top_k")
        if self.min_new_tokens > self.max_new_tokens:
            raise RequestValidationError(
                "sampling_params.min_new_tokens must not exceed max_new_tokens", "sampling_params.min_new_tokens"
            )
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            min_new_tokens=self.min_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            stop=tuple(stop),
            ignore_eos=self.ignore_eos,
            stream_interval=self.stream_interval,
            skip_special_tokens=self.skip_special_tokens,
            no_stop_trim=self.no_stop_trim,
        )


Room = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Port = Annotated[int, Meta(ge=1, le=65535)]
# tcp://host:port or ipc:///absolute/path: anything else would make ZeroMQ refuse it later.
_ENDPOINT = re.compile(r"tcp://[A-Za-z0-9.\-]+:[0-9]{1,5}|tcp://\[[0-9A-Fa-f:.]+\]:[0-9]{1,5}|ipc:///[^\s\x00]+")


class Bootstrap(msgspec.Struct, frozen=True):
    """PD disaggregation: the room shared by a request's prefill and decode halves, and the
    prefill server's KV endpoint the decode server fetches from."""

    room: int
    endpoint: str


def bootstrap_of(room: int | None, endpoint: str | None, host: str | None, port: int | None) -> Bootstrap | None:
    """The bootstrap fields of a request body (SGLang's ``bootstrap_host``/``bootstrap_port``,
    or a ZeroMQ ``bootstrap_endpoint``), or None when it has none."""
    if room is None and endpoint is None and host is None and port is None:
        return None
    if room is None:
        raise RequestValidationError("bootstrap_room is required with the other bootstrap fields", "bootstrap_room")
    if endpoint is None:
        if host is None:
            raise RequestValidationError("give bootstrap_endpoint, or bootstrap_host (and bootstrap_port)", "bootstrap_endpoint")
        endpoint = f"tcp://{f'[{host}]' if ':' in host else host}:{port if port is not None else 8998}"
    if len(endpoint) > 512 or _ENDPOINT.fullmatch(endpoint) is None:
        raise RequestValidationError(
            f"bootstrap endpoint {endpoint[:100]!r} is not tcp://host:port or ipc:///path", "bootstrap_endpoint"
        )
    return Bootstrap(room=room, endpoint=endpoint)


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    text: str | None = None
    input_ids: list[TokenId] | None = None
    sampling_params: GenerateSamplingParams = msgspec.field(default_factory=GenerateSamplingParams)
    stream: bool = False
    rid: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    image_data: list[str] | str | None = None
    audio_data: list[str] | str | None = None
    video_data: list[str] | str | None = None
    # PD disaggregation (set by `tokenpipe router`)
    bootstrap_room: Room | None = None
    bootstrap_endpoint: str | None = None
    bootstrap_host: str | None = None
    bootstrap_port: Port | None = None

    def bootstrap(self) -> Bootstrap | None:
        return bootstrap_of(self.bootstrap_room, self.bootstrap_endpoint, self.bootstrap_host, self.bootstrap_port)


class AbortRequestBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    rid: str | None = None
    abort_all: bool = False


def decode_body(body: bytes, type_: type) -> object:
    """Decodes a JSON body into ``type_``; every failure is a RequestValidationError."""
    if not body:
        raise RequestValidationError("request body is empty; expected a JSON object")
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestValidationError(f"request body is not valid UTF-8 (byte {exc.start})") from exc
    try:
        obj = msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        raise RequestValidationError(str(exc), _param_of(str(exc))) from exc
    except msgspec.DecodeError as exc:
        raise RequestValidationError(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # deep nesting inside a free-form (Any) field
        raise RequestValidationError("request body is nested too deeply") from exc
    if _LONG_DIGITS.search(body) is not None:
        where = _int_out_of_range(obj)
        if where is not None:
            message = f"Integer out of range: must fit a signed 64-bit integer - at `{where}`"
            raise RequestValidationError(message, _param_of(message))
    return obj


# msgspec decodes a JSON integer of any size into an `int` field, but no wire field can carry
# one beyond 64 bits (msgpack) and no field means anything there: refuse it as the client's
# error here rather than fail with a 500 when the request is encoded for the scheduler. Only an
# integer literal of 19 or more digits can be out of range, so other bodies skip the walk.
_LONG_DIGITS = re.compile(rb"\d{19}")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _int_out_of_range(obj: Any) -> str | None:
    """The path (``$.sampling_params.top_k``) of an int outside int64, or None."""
    stack: list[tuple[Any, str]] = [(obj, "$")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            if not _INT64_MIN <= value <= _INT64_MAX:
                return path
        elif isinstance(value, msgspec.Struct):
            stack.extend((getattr(value, name), f"{path}.{name}") for name in value.__struct_fields__)
        elif isinstance(value, (list, tuple)):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))
        elif isinstance(value, dict):
            stack.extend((item, f"{path}.{key}") for key, item in value.items())
    return None


def _param_of(message: str) -> str | None:
    """``... - at `$.sampling_params.top_p``` -> ``sampling_params.top_p``; an unknown key
    names itself: ``Object contains unknown field `foo` - at `$.x``` -> ``x.foo``."""
    marker = "- at `$."
    at = message.rfind(marker)
    where = message[at + len(marker) :].rstrip("`") if at >= 0 else None
    unknown = "unknown field `"
    if message.startswith("Object contains " + unknown):
        name = message[len("Object contains " + unknown) :].split("`", 1)[0]
        return f"{where}.{name}" if where else name
    return where
