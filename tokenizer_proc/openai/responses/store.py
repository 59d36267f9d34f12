"""Stored responses (``store: true``, OpenAI's default): each response object with the
conversation it closes (the items of its context, its input and its output), so that
``previous_response_id`` goes on from it and ``GET``/``DELETE /v1/responses/{id}`` find it.

One SQLite file in the service's private ipc directory (``TOKENPIPE_IPC_DIR``, mode 0700,
removed when the service stops), so every API worker (``--api-workers N``) reads and writes
the same store: a conversation can go on through any worker. A process run alone
(``tokenpipe api``) keeps a private directory of its own. Nothing outlives the service.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from pipeline.process_util import IPC_DIR_ENV
from pipeline.sockets import PrivateIpcDir

__all__ = ["ResponseStore", "StoredResponse"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    response BLOB NOT NULL,
    conversation BLOB NOT NULL,
    size INTEGER NOT NULL
)
"""


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # normalized items, oldest first


class ResponseStore:
    """The store of one SQLite file (see the module docstring). ``directory``: where the file
    lives (None: the service's ipc directory, or a private one of this process's).

    Bounded by count and by bytes (``--responses-store-max-count``,
    ``--responses-store-bytes``): a put that goes over either removes the oldest responses
    first. The bytes counted are the stored JSON's; a single response larger than the byte
    bound is not stored at all.

    The calls are synchronous: a put or get is one row, cheaper than the request's own
    tokenizing, and happens once per request, never per token."""

    FILE_NAME = "responses.sqlite3"

    def __init__(self, max_count: int, max_bytes: int, directory: Path | None = None) -> None:
        self._own_dir: PrivateIpcDir | None = None
        if directory is None:
            shared = os.environ.get(IPC_DIR_ENV)
            if shared:
                directory = Path(shared)
            else:
                self._own_dir = PrivateIpcDir()
                directory = self._own_dir.path
        self.path = directory / self.FILE_NAME
        self.max_count, self.max_bytes = max_count, max_bytes
        # Owner-only, as the directory is (SQLite gives its WAL files the database's mode).
        os.close(os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600))
        self._lock = threading.Lock()  # one connection per process; calls come from the event loop
        # Several workers open the file at once: wait for another's write instead of failing.
        self._db = sqlite3.connect(
            self.path, timeout=30.0, isolation_level=None, check_same_thread=False
        )
        # Switching to WAL needs the file to itself, and SQLite answers "database is locked"
        # at once, without its busy wait, when another worker is switching too: the workers
        # set the file up one at a time, behind an exclusive lock of a file beside it.
        lock_fd = os.open(
            directory / (self.FILE_NAME + ".setup-lock"), os.O_CREAT | os.O_RDWR, 0o600
        )
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(_SCHEMA)
        finally:
            os.close(lock_fd)  # closing releases the lock
        self._db.execute("PRAGMA synchronous=OFF")  # the store dies with the service anyway
        self._encoder = msgspec.json.Encoder()

    def put(
        self, response_id: str, response: dict[str, Any], conversation: list[dict[str, Any]]
    ) -> bool:
        """Stores a response; False when it alone is larger than the byte bound."""
        body, items = self._encoder.encode(response), self._encoder.encode(conversation)
        size = len(body) + len(items)
        if size > self.max_bytes:
            return False
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute(
                    "INSERT OR REPLACE INTO responses (id, response, conversation, size) VALUES "
                    "(?, ?, ?, ?)",
                    (response_id, body, items, size),
                )
                self._evict()
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return True

    def _evict(self) -> None:
        """The oldest responses out until the count and the bytes are within bounds."""
        count, total = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses"
        ).fetchone()
        if count <= self.max_count and total <= self.max_bytes:
            return
        over_count = max(0, count - self.max_count)
        removed = 0
        cut = None
        for seq, size in self._db.execute(
            "SELECT seq, size FROM responses ORDER BY seq"
        ).fetchall():
            if removed >= over_count and total <= self.max_bytes:
                break
            cut, removed, total = seq, removed + 1, total - size
        if cut is not None:
            self._db.execute("DELETE FROM responses WHERE seq <= ?", (cut,))

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute(
                "SELECT response, conversation FROM responses WHERE id = ?", (response_id,)
            ).fetchone()
        if row is None:
            return None
        return StoredResponse(msgspec.json.decode(row[0]), msgspec.json.decode(row[1]))

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return (
                self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0
            )

    def stats(self) -> tuple[int, int]:
        """(responses, bytes) stored now."""
        with self._lock:
            count, total = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses"
            ).fetchone()
        return int(count), int(total)

    def close(self) -> None:
        self._db.close()
        if self._own_dir is not None:
            self._own_dir.close()
