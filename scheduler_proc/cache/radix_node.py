"""The radix tree's nodes: a run of token ids and the KV slots that hold them, one tree per
``CacheNamespace`` under its ``RadixRoot`` (``scheduler_proc.cache.radix_cache`` keeps the
tree's invariants)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from pipeline.control_frames import LoraAdapter
from pipeline.kv_events import MEDIUM_CPU, MEDIUM_STORAGE

_EMPTY_KEY = np.empty(0, dtype=np.int64)


def empty_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.long)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token runs, in one vectorised compare."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class StorageRef(NamedTuple):
    """Where a storage node's K/V is: tokens [offset, offset + length) of file ``key``
    (a split node's halves share one file)."""

    key: str
    offset: int
    length: int


class RadixNode:
    __slots__ = (
        "children",
        "key",
        "value",
        "lock_ref",
        "last_access",
        "parent",
        "host_value",
        "storage",
        "block_hashes",
    )

    def __init__(
        self,
        key: np.ndarray,
        value: torch.Tensor | None,
        parent: RadixNode | None,
        last_access: float = 0.0,
    ) -> None:
        self.children: dict[int, RadixNode] = {}
        self.key = key  # int64 token ids, one per slot in value
        self.value = value  # CPU int64 pool slots; None while the KV lives in a lower tier
        # Owned by the lower tiers (HiCache) while value is None: host pool slots, or a
        # reference into a storage file.
        self.host_value: torch.Tensor | None = None
        self.storage: StorageRef | None = None
        self.lock_ref = 0
        self.last_access = last_access
        # KV cache events (scheduler_proc/kv_events): the hashes of the full blocks whose
        # last token lies in this node; None while nobody has computed them.
        self.block_hashes: list[bytes] | None = None
        # None for the root and, once evicted, for a removed node: that is what marks
        # its stale heap entries.
        self.parent = parent

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return (
            f"RadixNode(len={len(self.key)}, lock_ref={self.lock_ref},"
            f" children={len(self.children)})"
        )


class CacheNamespace(NamedTuple):
    """What keys a prefix besides its tokens: requests share cached KV only within one
    namespace, whose tree hangs from its own root. ``salt``: the tenant's ``cache_salt``
    (None: unsalted); ``lora``: the adapter the KV was computed with (None: the base model),
    load id included, so a reloaded adapter never reads its old weights' KV."""

    salt: str | None = None
    lora: LoraAdapter | None = None


UNSALTED = CacheNamespace()


class RadixRoot(RadixNode):
    """The top of one namespace's tree: it holds no tokens and is never evicted."""

    __slots__ = ("namespace",)

    def __init__(self, namespace: CacheNamespace) -> None:
        super().__init__(_EMPTY_KEY, empty_slots(), None)
        self.namespace = namespace
        self.lock_ref = 1  # never evictable


def lower_medium(node: RadixNode) -> str | None:
    """The lower tier an off-device node's KV is in (KV cache events' medium names), or None
    for a device node and for one between HiCache's fetch and install (in no tier)."""
    if node.host_value is not None:
        return MEDIUM_CPU
    if node.storage is not None:
        return MEDIUM_STORAGE
    return None
