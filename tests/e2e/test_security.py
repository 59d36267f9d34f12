"""The security properties the "Security" section of docs/operations.md claims, checked for real:
the ipc directory keeps other users out, no socket carries pickle (a pickle frame runs no code), a
tcp endpoint listens only where it is configured, and the API key is compared in constant time,
refuses every wrong key with an OpenAI-style 401 and is not needed on /, /health and /metrics."""

from __future__ import annotations

import ast
import inspect
import json
import os
import pickle
import shutil
import socket
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq

from pipeline.sockets import PrivateIpcDir
from tokenizer_proc.openai.responses.store import ResponseStore
from tests.server_harness import REPO, RoleProcesses, ServerProcess
from pipeline.http import edge as http_edge

API_KEY = "tp-Secret-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GENERATE = {
    "text": "secure",
    "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
}


# --- the three processes on explicit tcp endpoints, with an API key -------------------------


@pytest.fixture(scope="module")
def tcp_service() -> Iterator[RoleProcesses]:
    with RoleProcesses(["--api-key", API_KEY], headers=AUTH) as svc:
        yield svc


# --- ipc: a private directory -------------------------------------------------------------


def test_the_servers_ipc_dir_is_owner_only_and_holds_its_sockets(server: ServerProcess) -> None:
    (ipc_dir,) = list(server.tmp_dir.iterdir())
    st = ipc_dir.stat()
    assert ipc_dir.name.startswith("tokenpipe-") and ipc_dir.is_dir()
    assert st.st_mode & 0o777 == 0o700, oct(st.st_mode)
    assert st.st_uid == os.getuid()
    names = {p.name for p in ipc_dir.iterdir()}
    assert {"scheduler", "detokenizer", "tokenizer"} <= names
    # Besides the sockets: only the Responses API's store (SQLite and its WAL files), owner-only.
    store = {n for n in names if not (ipc_dir / n).is_socket()}
    assert all(n.startswith(ResponseStore.FILE_NAME) for n in store), store
    assert all((ipc_dir / n).stat().st_mode & 0o777 == 0o600 for n in store), store


def test_private_ipc_dir_is_0700_whatever_the_umask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    old = os.umask(0)
    try:
        ipc = PrivateIpcDir()
    finally:
        os.umask(old)
    assert ipc.path.parent == tmp_path
    assert ipc.path.stat().st_mode & 0o777 == 0o700
    ipc.close()
    assert not ipc.path.exists()


_CONNECT = textwrap.dedent(
    """
    import socket, sys
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(sys.argv[1])
        print("connected")
    except PermissionError:
        print("EACCES")
    """
)


def _connect_as_nobody(path: Path) -> str:
    run = subprocess.run(
        [_SYSTEM_PYTHON, "-c", _CONNECT, str(path)],
        user=65534,
        group=65534,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return run.stdout.strip() or run.stderr


_SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or ""


@pytest.mark.skipif(
    os.geteuid() != 0 or not _SYSTEM_PYTHON,
    reason="needs root (to act as user nobody) and /usr/bin/python3",
)
def test_another_user_cannot_reach_a_socket_in_the_private_dir(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Even with a world-writable socket file, the 0700 directory alone keeps user nobody out."""
    parent = Path(
        tempfile.mkdtemp(prefix="tp-sec-", dir="/tmp")
    )  # /tmp: nobody can walk down to it
    parent.chmod(0o755)
    monkeypatch.setattr(tempfile, "tempdir", str(parent))
    ipc = PrivateIpcDir()
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PULL)
        sock.bind(ipc.endpoint("scheduler"))
        socket_file = ipc.path / "scheduler"
        socket_file.chmod(0o777)
        assert _connect_as_nobody(socket_file) == "EACCES"
        ipc.path.chmod(0o755)  # control: the directory is the only barrier
        assert _connect_as_nobody(socket_file) == "connected"
    finally:
        ctx.destroy(linger=0)
        ipc.close()
        shutil.rmtree(parent, ignore_errors=True)


# --- frames are data: no pickle -------------------------------------------------------------

_PICKLE_MODULES = {
    "pickle",
    "cPickle",
    "_pickle",
    "cloudpickle",
    "dill",
    "marshal",
    "shelve",
    "joblib",
}
_PICKLE_CALLS = {"send_pyobj", "recv_pyobj", "recv_serialized", "send_serialized"}


def _source_files() -> list[Path]:
    """Every .py of the project but bench/ and tests/ (and hidden or build directories)."""
    skip = {"bench", "tests", "build", "dist", "node_modules", "site-packages", "__pycache__"}
    files = []
    for root, dirs, names in os.walk(REPO):
        dirs[:] = [
            d
            for d in dirs
            if not d.startswith(".") and d not in skip and not d.endswith(".egg-info")
        ]
        files += [Path(root) / n for n in names if n.endswith(".py")]
    return files


def test_no_module_uses_pickle() -> None:
    files = _source_files()
    assert any(f.relative_to(REPO).as_posix() == "pipeline/sockets.py" for f in files)
    found = []
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").split(".")[0]]
            elif isinstance(node, ast.Attribute):
                names = [node.attr] if node.attr in _PICKLE_CALLS else []
                # torch.load and numpy.load(allow_pickle=True) unpickle too.
                if (
                    node.attr == "load"
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "torch"
                ):
                    names = ["torch.load"]
            else:
                continue
            for name in names:
                if name in _PICKLE_MODULES or name in _PICKLE_CALLS or name == "torch.load":
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
        if "allow_pickle=True" in path.read_text():
            found.append(f"{path.relative_to(REPO)}: allow_pickle=True")
    assert not found, found


class _Evil:
    """Unpickling this creates ``path``: proof that a frame ran code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (open, (self.path, "w"))


def test_a_pickle_frame_runs_no_code_and_a_junk_frame_is_dropped(
    tcp_service: RoleProcesses, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Evil(str(marker)))
    ctx = zmq.Context()
    try:
        for port in tcp_service.zmq_ports.values():
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 2000)
            push.connect(f"tcp://127.0.0.1:{port}")
            for frame in (payload, b"\x00\xff junk", b"\x93\x01\x02\x03", b""):
                push.send(frame)
            push.close()
    finally:
        ctx.term()
    time.sleep(1.0)
    assert not marker.exists(), "a pickle frame was unpickled"
    r = httpx.post(tcp_service.url + "/generate", json=GENERATE, headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 3
    assert all(p.alive() for p in tcp_service.procs.values())


# --- tcp endpoints listen where configured ----------------------------------------------------


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on, from /proc/net/tcp{,6}."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table, family in (
        (f"/proc/{pid}/net/tcp", socket.AF_INET),
        (f"/proc/{pid}/net/tcp6", socket.AF_INET6),
    ):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            addr_hex, port_hex = local.split(":")
            raw = b"".join(
                bytes.fromhex(addr_hex[i : i + 8])[::-1] for i in range(0, len(addr_hex), 8)
            )
            found.add((socket.inet_ntop(family, raw), int(port_hex, 16)))
    return found


def test_tcp_endpoints_listen_only_on_the_configured_address(tcp_service: RoleProcesses) -> None:
    ports = tcp_service.zmq_ports
    expected = {
        "scheduler": {("127.0.0.1", ports["scheduler"])},
        "detokenizer": {("127.0.0.1", ports["detokenizer"])},
        "api": {("127.0.0.1", ports["tokenizer"]), ("127.0.0.1", tcp_service.port)},
    }
    for role, proc in tcp_service.procs.items():
        assert _listening(proc.pid) == expected[role], role


def test_serve_listens_on_loopback_http_only(server: ServerProcess) -> None:
    """By default the only TCP socket of the whole service is the HTTP port on 127.0.0.1."""
    children = server.children()
    listening = {role: _listening(pid) for role, pid in children.items()}
    listening["supervisor"] = _listening(server.proc.pid)
    assert listening == {
        "scheduler": set(),
        "detokenizer": set(),
        "api": {("127.0.0.1", server.port)},
        "supervisor": set(),
    }


# --- the API key ------------------------------------------------------------------------------


def test_api_key_auth_compares_with_hmac_compare_digest() -> None:
    source = textwrap.dedent(inspect.getsource(http_edge.ApiKeyAuth))
    tree = ast.parse(source)
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "compare_digest"
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == "hmac"
    ]
    assert len(calls) == 1, "ApiKeyAuth must compare the key with hmac.compare_digest"
    # The header's value against the expected one, taken from `self._expected`.
    assert [ast.unparse(a) for a in calls[0].args] == ["given", "expected"]
    assert "expected = self._expected.get(name)" in source
    assert http_edge.hmac.compare_digest is __import__("hmac").compare_digest
    # No other comparison ever touches the key (== would leak its length of matching prefix);
    # `is None` tests only whether a header is the key's.
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and not all(
            isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops
        ):
            names = {getattr(n, "attr", None) or getattr(n, "id", None) for n in ast.walk(node)}
            assert not names & {"_expected", "expected", "given", "api_key"}, ast.unparse(node)


def _wrong_authorizations() -> list[bytes]:
    key = API_KEY
    wrong: list[str] = []
    for length in range(len(key) + 3):
        if length < len(key):
            wrong.append(key[:length])  # every prefix, the empty one included
        filler = ("x" * length) if length != len(key) else key[:-1] + "X"
        wrong.append(filler)  # a wrong key of each length (the right length: last byte off)
    wrong += [key + "x", "x" + key, key.upper(), key[1:], key.swapcase()]
    headers = [f"Bearer {w}" for w in wrong]
    # (Whitespace around a header value is not part of it (RFC 9110), so "Bearer KEY " is right.)
    headers += [
        key,
        f"bearer {key}",
        f"Bearer  {key}",
        f"Bearer\t{key}",
        f"Basic {key}",
        "Bearer",
        "",
        f"Token {key}",
    ]
    return [h.encode() for h in headers] + [b"Bearer " + key.encode()[:-1] + b"\xff"]


def _raw_request(
    port: int, method: str, path: str, authorization: bytes | None
) -> tuple[int, bytes]:
    """One HTTP/1.1 request over a plain socket, so that any header bytes can be sent."""
    body = json.dumps(GENERATE).encode() if method == "POST" else b""
    head = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1", b"Connection: close"]
    if authorization is not None:
        head.append(b"Authorization: " + authorization)
    if body:
        head += [b"Content-Type: application/json", f"Content-Length: {len(body)}".encode()]
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"\r\n".join(head) + b"\r\n\r\n" + body)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    response = b"".join(chunks)
    status = int(response.split(b" ", 2)[1])
    return status, response.partition(b"\r\n\r\n")[2]


def test_every_wrong_key_gets_an_openai_style_401(tcp_service: RoleProcesses) -> None:
    wrong: list[bytes | None] = [*_wrong_authorizations(), None]
    assert len(wrong) > 2 * len(API_KEY)
    for authorization in wrong:
        for method, path in (
            ("POST", "/generate"),
            ("GET", "/v1/models"),
            ("GET", "/server_info"),
            ("GET", "/health_generate"),
        ):
            status, body = _raw_request(tcp_service.port, method, path, authorization)
            assert status == 401, (authorization, path, status, body)
            error = json.loads(body)["error"]
            assert (
                error["code"] == 401
                and error["type"] == "authentication_error"
                and error["message"]
            ), error
            assert API_KEY.encode() not in body
    # The same raw request with the right key works, and nothing echoes the key back.
    status, body = _raw_request(tcp_service.port, "POST", "/generate", f"Bearer {API_KEY}".encode())
    assert status == 200 and json.loads(body)["meta_info"]["completion_tokens"] == 3
    info = httpx.get(tcp_service.url + "/server_info", headers=AUTH, timeout=30)
    assert info.status_code == 200 and "api_key" not in info.json() and API_KEY not in info.text


def test_root_health_and_metrics_need_no_key(tcp_service: RoleProcesses) -> None:
    with httpx.Client(base_url=tcp_service.url, timeout=30) as c:
        assert c.get("/").status_code == 200 and c.head("/").status_code == 200
        assert c.get("/health").status_code == 200
        metrics = c.get("/metrics")
        assert metrics.status_code == 200 and "tokenpipe:" in metrics.text
        assert API_KEY not in metrics.text
    # Only those exact paths are open. (Raw requests: httpx would send "//health" as "/".)
    for path in ("/health/", "/health_generate", "/metrics/x", "//health", "//", "/v1/"):
        status, _ = _raw_request(tcp_service.port, "GET", path, None)
        assert status == 401, path
    assert all(p.alive() for p in tcp_service.procs.values())
