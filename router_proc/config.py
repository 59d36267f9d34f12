"""``RouterConfig``, the one typed config of ``tokenpipe router``, and its CLI flags."""

from __future__ import annotations

import argparse
from urllib.parse import urlsplit

import msgspec


class RouterConfig(msgspec.Struct, kw_only=True, frozen=True):
    prefill_url: str  # http(s)://host:port of a `serve --disaggregation-mode prefill`
    decode_url: str  # http(s)://host:port of a `serve --disaggregation-mode decode`
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None  # required from clients, and sent to both servers
    request_timeout: float = 600.0  # longest wait for a server's next bytes
    # A server that does not accept a connection within seconds is down, not busy; /health
    # and /server_info probes use the same bound.
    connect_timeout: float = 5.0
    graceful_timeout: float = 30.0
    log_level: str = "info"
    max_request_bytes: int = 64 * 1024 * 1024  # as `tokenpipe serve`: a larger body gets 413
    request_read_timeout: float = 30.0  # as `tokenpipe serve`: a slower client is dropped

    def validate(self) -> None:
        problems = [p for p in (_url_problem("--prefill-url", self.prefill_url), _url_problem("--decode-url", self.decode_url)) if p]
        if self.request_timeout <= 0:
            problems.append("--request-timeout must be positive")
        if not 0 <= self.port < 65536:
            problems.append("--port must be a TCP port (0-65535)")
        if self.max_request_bytes <= 0 or self.request_read_timeout <= 0:
            problems.append("--max-request-bytes and --request-read-timeout must be positive")
        if self.api_key == "":
            problems.append("--api-key must not be empty")
        if problems:
            raise ValueError("; ".join(problems))


def _url_problem(flag: str, url: str) -> str | None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{flag} must be an http:// or https:// URL with a host, not {url!r}"
    if parts.query or parts.fragment:
        return f"{flag} must not have a query or fragment: {url!r}"
    return None


def add_router_args(parser: argparse.ArgumentParser) -> None:
    d = RouterConfig(prefill_url="", decode_url="")
    parser.add_argument("--prefill-url", required=True, help="URL of a `tokenpipe serve --disaggregation-mode prefill`")
    parser.add_argument("--decode-url", required=True, help="URL of a `tokenpipe serve --disaggregation-mode decode`")
    parser.add_argument("--host", default=d.host)
    parser.add_argument("--port", type=int, default=d.port)
    parser.add_argument("--api-key", default=d.api_key, help="clients must send `Authorization: Bearer KEY`; sent on to both servers")
    parser.add_argument(
        "--request-timeout", type=float, default=d.request_timeout, help="seconds to wait for a server's next bytes before failing the request"
    )
    parser.add_argument("--graceful-timeout", type=float, default=d.graceful_timeout)
    parser.add_argument("--log-level", default=d.log_level)
    parser.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes, help="a larger request body gets 413")
    parser.add_argument(
        "--request-read-timeout", type=float, default=d.request_read_timeout, help="seconds a client may take to send headers, and between body parts"
    )


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    config = RouterConfig(
        prefill_url=args.prefill_url.rstrip("/"),
        decode_url=args.decode_url.rstrip("/"),
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        request_timeout=args.request_timeout,
        graceful_timeout=args.graceful_timeout,
        log_level=args.log_level,
        max_request_bytes=args.max_request_bytes,
        request_read_timeout=args.request_read_timeout,
    )
    config.validate()
    return config
