"""The two servers behind the router: what each one is (``/server_info``), whether they
form a PD pair, their health, and every call the router makes to them on its own behalf.
Each failure becomes a ``PeerError`` that names the server, so a client can tell which
half of the pair is wrong."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx

_WILDCARD_HOSTS = frozenset({"0.0.0.0", "*", "::", "[::]"})


class PeerError(Exception):
    """A server that cannot take part in a request: the status and message the client gets."""

    def __init__(self, status: int, message: str, err_type: str = "bad_gateway") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type


@dataclass(frozen=True, slots=True)
class Peer:
    role: str  # "prefill" or "decode": the disaggregation mode it must report
    url: str

    def __str__(self) -> str:
        return f"{self.role} server {self.url}"

    def failed(self, exc: httpx.HTTPError, timeout: float) -> PeerError:
        """502 for a server that cannot be reached, 504 for one that stalls past ``timeout``."""
        if isinstance(exc, httpx.ConnectTimeout):
            return PeerError(502, f"{self} unreachable: no connection within the connect timeout")
        if isinstance(exc, httpx.TimeoutException):
            return PeerError(504, f"{self} did not answer within {timeout:g} s ({type(exc).__name__})", "gateway_timeout")
        return PeerError(502, f"{self} unreachable: {str(exc) or type(exc).__name__}")


@dataclass(frozen=True, slots=True)
class PairInfo:
    prefill: dict[str, Any]
    decode: dict[str, Any]
    bootstrap_endpoint: str  # where the decode server fetches KV from the prefill server


class Peers:
    def __init__(self, client: httpx.AsyncClient, prefill_url: str, decode_url: str, *, api_key: str | None, probe_timeout: float) -> None:
        self.prefill = Peer("prefill", prefill_url)
        self.decode = Peer("decode", decode_url)
        self._client = client
        self._auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._probe_timeout = probe_timeout
        self._pair: PairInfo | None = None
        self._lock = asyncio.Lock()

    async def pair(self) -> PairInfo:
        """Found on the first request and kept. A failure is not kept: a later request asks
        again, since a server may still have been starting or may come back in the right mode."""
        if self._pair is None:
            async with self._lock:  # one discovery at a time, however many requests wait on it
                if self._pair is None:
                    self._pair = await self._discover()
        return self._pair

    def forget(self) -> None:
        """A server could not be reached: it may come back with another bootstrap endpoint."""
        self._pair = None

    async def server_infos(self) -> tuple[dict[str, Any], dict[str, Any]]:
        prefill, decode = await asyncio.gather(self._server_info(self.prefill), self._server_info(self.decode), return_exceptions=True)
        for result in (prefill, decode):
            if isinstance(result, BaseException):
                raise result
        return prefill, decode  # type: ignore[return-value]

    async def health(self) -> list[str]:
        """What is wrong with each server's /health; empty when both answer 200."""
        return [problem for problem in await asyncio.gather(self._health(self.prefill), self._health(self.decode)) if problem]

    async def get(self, peer: Peer, path: str, headers: dict[str, str]) -> httpx.Response:
        try:
            return await self._client.get(peer.url + path, headers=headers, timeout=self._probe_timeout)
        except httpx.HTTPError as exc:
            raise peer.failed(exc, self._probe_timeout) from None

    async def abort(self, peer: Peer, rid: str) -> None:
        """Best effort: usually closing the connection has already aborted the request, and
        then the server answers 404."""
        try:
            await self._client.post(peer.url + "/abort_request", json={"rid": rid}, headers=self._auth, timeout=self._probe_timeout)
        except httpx.HTTPError:
            pass

    async def _discover(self) -> PairInfo:
        prefill, decode = await self.server_infos()
        _check_mode(self.prefill, prefill)
        _check_mode(self.decode, decode)
        # A mismatch the KV transfer might not catch (same shapes, other weights) gives wrong text.
        if prefill.get("model_name") != decode.get("model_name"):
            raise PeerError(
                502, f"{self.prefill} serves model {prefill.get('model_name')!r} but {self.decode} serves {decode.get('model_name')!r}"
            )
        return PairInfo(prefill=prefill, decode=decode, bootstrap_endpoint=_bootstrap_endpoint(self.prefill, prefill))

    async def _server_info(self, peer: Peer) -> dict[str, Any]:
        response = await self.get(peer, "/server_info", self._auth)
        if response.status_code != 200:
            hint = " (servers with --api-key need the router started with the same --api-key)" if response.status_code == 401 else ""
            raise PeerError(502, f"{peer} answered GET /server_info with {response.status_code}: {response.text[:200]}{hint}")
        try:
            info = response.json()
        except ValueError:
            info = None
        if not isinstance(info, dict):
            raise PeerError(502, f"{peer} answered GET /server_info with something other than a JSON object: {response.text[:200]}")
        return info

    async def _health(self, peer: Peer) -> str | None:
        try:
            response = await self.get(peer, "/health", {})
        except PeerError as exc:
            return exc.message
        return None if response.status_code == 200 else f"{peer} answered GET /health with {response.status_code}"


def _check_mode(peer: Peer, info: dict[str, Any]) -> None:
    mode = info.get("disaggregation_mode")
    if mode != peer.role:
        raise PeerError(
            502,
            f"{peer} is not in {peer.role} mode: its /server_info reports disaggregation_mode {mode!r} "
            f"(start it with `tokenpipe serve --disaggregation-mode {peer.role}`)",
        )


def _bootstrap_endpoint(peer: Peer, info: dict[str, Any]) -> str:
    endpoint = info.get("disaggregation_bootstrap_endpoint")
    if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://")):
        raise PeerError(502, f"{peer} reports no usable disaggregation_bootstrap_endpoint in /server_info: {endpoint!r}")
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if endpoint.startswith("tcp://") and sep and host in _WILDCARD_HOSTS:
        # Bound on every interface: a decode server reaches it the way the router does.
        return f"tcp://{_url_host(peer.url)}:{port}"
    return endpoint


def _url_host(url: str) -> str:
    host = httpx.URL(url).host
    return f"[{host}]" if ":" in host else host
