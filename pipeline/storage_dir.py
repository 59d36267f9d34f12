"""Whether a directory can hold HiCache storage files (``--hicache-storage-dir``)."""

from __future__ import annotations

import os


def storage_dir_problem(directory: str) -> str | None:
    """Why ``directory`` cannot hold HiCache storage files, or None when it can. Checked by
    the scheduler (the process that writes there) and, for ``serve``, by the CLI first."""
    if not directory:
        return "the directory is empty: give the absolute path of an existing directory"
    if not os.path.isabs(directory):
        return f"the directory must be an absolute path, got {directory!r}"
    if not os.path.exists(directory):
        return f"storage directory {directory!r} does not exist"
    if not os.path.isdir(directory):
        return f"storage path {directory!r} is not a directory"
    if not os.access(directory, os.R_OK | os.W_OK | os.X_OK):
        return f"storage directory {directory!r} is not readable and writable by the scheduler"
    return None
