"""A ``tokenpipe serve`` killed with SIGKILL cannot clean up itself: its children notice,
remove the private ipc directory and stop, so neither a socket file nor a process is left."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.server_harness import ServerProcess, descendants, pid_alive, wait_until

# Generous for a busy 2-core machine: a child notices within a fraction of a second and
# exits hard at most a few seconds later.
GONE_WITHIN = 15.0


def _process_tree(pid: int) -> set[int]:
    """Every live descendant of ``pid``, children of children included."""
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        children = set(descendants(frontier.pop())) - found
        found |= children
        frontier.extend(children)
    return found


def test_sigkill_of_the_supervisor_leaves_no_ipc_dir_and_no_process(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    srv = ServerProcess(tmp).wait_ready()
    tree: set[int] = set()
    try:
        children = srv.children()
        assert set(children) == {"scheduler", "detokenizer", "api"}, children
        tree = _process_tree(srv.proc.pid)
        ipc_dirs = list(tmp.iterdir())
        assert len(ipc_dirs) == 1 and ipc_dirs[0].is_dir(), ipc_dirs  # the private ipc directory

        os.kill(srv.proc.pid, signal.SIGKILL)
        assert srv.proc.wait(timeout=10) == -signal.SIGKILL

        assert wait_until(lambda: not any(pid_alive(p) for p in tree), timeout=GONE_WITHIN), (
            f"orphans left: {sorted(p for p in tree if pid_alive(p))}"
        )
        assert wait_until(lambda: not ipc_dirs[0].exists(), timeout=GONE_WITHIN), (
            "the ipc directory was left behind"
        )
        assert list(tmp.iterdir()) == [], "something was left in TMPDIR"
    finally:
        srv.stop(signal.SIGKILL)
        for pid in tree:  # never leave a stray server process behind a failure
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
