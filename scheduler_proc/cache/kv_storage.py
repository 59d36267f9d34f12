"""HiCache's storage tier: one file per evicted KV segment in a directory, attached and
detached at runtime (``HiCache.attach_storage``). ``NoStorage`` stands in while none is
attached, so HiCache calls the tier without asking whether it is there.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pipeline.storage_dir import storage_dir_problem

logger = logging.getLogger("tokenpipe.scheduler")

STORAGE_BACKENDS = ("file",)


class StorageError(ValueError):
    """A storage attach that cannot work; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class NoStorage:
    """The storage tier while none is attached: it stores and finds nothing."""

    attached = False
    backend: str | None = None
    dir: Path | None = None

    def put(self, key: str, k: torch.Tensor, v: torch.Tensor) -> bool:
        return False

    def get(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None


class FileStorage:
    """One file per stored segment, ``<key>.kv`` (a safetensors file of its K and V, shaped
    [layers, tokens, kv_heads, head_dim]), written to a temporary name and renamed, so a
    reader never sees half a file. ``index`` maps the keys present to their sizes; it is
    read from the directory at attach time and kept up to date by ``put``."""

    attached = True
    backend = "file"
    SUFFIX = ".kv"

    def __init__(self, directory: str) -> None:
        problem = storage_dir_problem(directory)
        if problem is not None:
            raise StorageError(problem, "dir")
        path = Path(directory)
        self.dir = path
        self.index: dict[str, int] = {}
        for entry in path.iterdir():
            if entry.suffix == self.SUFFIX and entry.is_file():
                self.index[entry.stem] = entry.stat().st_size

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}{self.SUFFIX}"

    def put(self, key: str, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Stores a segment; True when it is there (already, or now)."""
        if key in self.index and self._path(key).exists():
            return True
        tmp = self.dir / f".{key}.{os.getpid()}.tmp"
        try:
            save_file(
                {"k": k.detach().to("cpu").contiguous(), "v": v.detach().to("cpu").contiguous()},
                str(tmp),
            )
            os.replace(tmp, self._path(key))
            self.index[key] = self._path(key).stat().st_size
            return True
        except OSError as exc:
            logger.warning("HiCache storage: could not write %s: %s", self._path(key), exc)
            tmp.unlink(missing_ok=True)
            return False

    def get(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A stored segment's K and V (CPU), or None when it is gone or unreadable."""
        try:
            # safetensors: a stored file is raw tensor bytes and a header, never code.
            data = load_file(str(self._path(key)), device="cpu")
            return data["k"], data["v"]
        except Exception as exc:  # missing, truncated or foreign file: a miss, not a crash
            logger.warning("HiCache storage: could not read %s: %s", self._path(key), exc)
            self.index.pop(key, None)
            return None
