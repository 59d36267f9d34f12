"""The Responses API's store (tokenizer_proc/openai/responses/store.py): bounded by count and bytes
with the oldest out first, a response larger than the bound not stored, and one file that
another process (another API worker) reads and writes."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from tokenizer_proc.openai.responses.store import ResponseStore


def _response(i: int, pad: int = 0) -> dict[str, object]:
    return {
        "id": f"resp_{i}",
        "object": "response",
        "output": [{"type": "message", "text": "x" * pad}],
    }


def test_the_oldest_go_first_when_the_count_is_over(tmp_path: Path) -> None:
    store = ResponseStore(max_count=3, max_bytes=1 << 20, directory=tmp_path)
    for i in range(5):
        assert store.put(
            f"resp_{i}", _response(i), [{"type": "message", "role": "user", "content": []}]
        )
    assert [store.get(f"resp_{i}") is not None for i in range(5)] == [
        False,
        False,
        True,
        True,
        True,
    ]
    stored = store.get("resp_4")
    assert (
        stored is not None
        and stored.response == _response(4)
        and stored.conversation[0]["role"] == "user"
    )
    assert store.stats()[0] == 3
    store.close()


def test_the_oldest_go_first_when_the_bytes_are_over_and_a_too_large_one_is_not_stored(
    tmp_path: Path,
) -> None:
    store = ResponseStore(max_count=100, max_bytes=3000, directory=tmp_path)
    for i in range(4):
        assert store.put(f"resp_{i}", _response(i, pad=900), [])
    count, size = store.stats()
    assert (
        size <= 3000
        and count == 3
        and store.get("resp_0") is None
        and store.get("resp_3") is not None
    )
    assert not store.put("resp_big", _response(9, pad=4000), [])
    assert store.get("resp_big") is None and store.stats() == (count, size)
    assert store.delete("resp_3") and not store.delete("resp_3") and store.get("resp_3") is None
    store.close()


def _put_from_another_process(directory: str) -> None:
    store = ResponseStore(max_count=10, max_bytes=1 << 20, directory=Path(directory))
    store.put("resp_other", _response(7), [])
    store.close()


def test_another_process_shares_the_store(tmp_path: Path) -> None:
    store = ResponseStore(max_count=10, max_bytes=1 << 20, directory=tmp_path)
    store.put("resp_mine", _response(1), [])
    process = multiprocessing.get_context("spawn").Process(
        target=_put_from_another_process, args=(str(tmp_path),)
    )
    process.start()
    process.join(60)
    assert process.exitcode == 0
    other = store.get("resp_other")
    assert other is not None and other.response == _response(7)
    assert store.stats()[0] == 2
    store.close()


def test_a_store_of_its_own_lives_in_a_private_directory_removed_at_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TOKENPIPE_IPC_DIR", raising=False)
    store = ResponseStore(max_count=10, max_bytes=1 << 20)
    assert store.path.exists() and (store.path.parent.stat().st_mode & 0o777) == 0o700
    store.close()
    assert not store.path.parent.exists()


def _open_store(directory: str) -> None:
    ResponseStore(10, 1 << 20, Path(directory))


def test_workers_opening_a_new_store_at_once_all_succeed(tmp_path: Path) -> None:
    """API workers start together and each opens the shared file: the first ones switch it
    to WAL, which SQLite refuses at once ("database is locked") to a concurrent switcher."""
    ctx = multiprocessing.get_context("fork")
    for round_ in range(20):
        directory = tmp_path / str(round_)
        directory.mkdir()
        procs = [ctx.Process(target=_open_store, args=(str(directory),)) for _ in range(8)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0] * 8, round_
