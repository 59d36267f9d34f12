"""HiCache: a host tier and an optional storage tier under the device KV pool.

Tiers, top to bottom: the device ``KVPool`` the model reads (``RadixNode.value``); a second
``KVPool`` of ``--hicache-host-tokens`` slots in host memory (``RadixNode.host_value``: a
separate pool even on a CPU-only machine, so every move is a real copy); storage, one file
per evicted segment (``kv_storage.FileStorage``, ``RadixNode.storage``). Each node lives in
exactly one tier, and tiers only get lower going down the tree: device nodes form a subtree
from the root, host-or-device nodes another.

Copies and file writes are synchronous, in the scheduler's step: simple and exact, at the
cost of stalling a step while a large prefix moves (SGLang overlaps them with compute).
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.control_frames import HiCacheStorageControl, HiCacheStorageState
from pipeline.io_struct import CachedTokensDetails
from pipeline.kv_events import MEDIUM_CPU, MEDIUM_STORAGE
from scheduler_proc.cache.kv_pool import KVPool
from scheduler_proc.cache.kv_storage import (
    STORAGE_BACKENDS,
    FileStorage,
    NoStorage,
    StorageError,
)
from scheduler_proc.cache.radix_cache import DeviceOnly, RadixCache
from scheduler_proc.cache.radix_node import RadixNode, RadixRoot, StorageRef, common_prefix_len

logger = logging.getLogger("tokenpipe.scheduler")


def cached_details(
    device: int, host: int, storage: int, backend: str | None
) -> CachedTokensDetails | None:
    """``cached_tokens_details`` for hits per tier: the storage keys only while storage is
    attached; None when nothing was cached and no storage is attached. After a detach a
    request's storage hits no longer show, though ``cached_tokens`` still counts them."""
    if backend is not None:
        return CachedTokensDetails(
            device=device, host=host, storage=storage, storage_backend=backend
        )
    if device + host + storage == 0:
        return None
    return CachedTokensDetails(device=device, host=host)


HICACHE_OFF = (
    "HiCache is off on this server: start it with --hicache-host-tokens N to use a storage tier"
)


def storage_state(
    control_id: int, storage: FileStorage | NoStorage, error: StorageError | None
) -> HiCacheStorageState:
    """The answer to an attach/detach: whether it worked, and the storage attached after it."""
    return HiCacheStorageState(
        control_id=control_id,
        ok=error is None,
        error=str(error) if error is not None else "",
        param=error.param if error is not None else None,
        backend=storage.backend,
        dir=str(storage.dir) if storage.attached else None,
    )


@dataclass
class Fetched:
    """K/V taken out of the lower tiers for one request, waiting for device slots."""

    nodes: list[RadixNode] = field(default_factory=list)
    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)
    host_tokens: int = 0
    storage_tokens: int = 0
    storage_seconds: float = 0.0

    @property
    def num_tokens(self) -> int:
        return self.host_tokens + self.storage_tokens


class HiCache:
    """The host pool, the storage backend and the tier bookkeeping of the radix tree's
    off-device nodes. Implements ``radix_cache.LowerTiers``.

    Life of a prefix. The radix tree evicts an unlocked device leaf: ``demote`` copies its
    K/V into the host pool (evicting host leaves first when the host is full) and the node
    stays in the tree with ``value`` None. A host leaf evicted for room is written to
    storage when storage is attached, and dropped otherwise. A node too large for the whole
    host pool goes straight to storage.

    A prefix match walks the device nodes (``RadixCache.match_prefix``), then the lower-tier
    nodes below them (``match_below``). The scheduler checks the device pool can take those
    tokens, ``fetch`` takes their K/V out of the host pool and reads their storage files
    (timed: that is the request's ``storage_prefetch_wait``), the scheduler allocates device
    slots, and ``install`` copies the K/V in and puts the nodes back on the device. Between
    ``fetch`` and ``install`` the nodes hold no tier at all, so the evictions that the device
    allocation may cause can never touch them.

    Storage can be attached and detached at runtime (``attach_storage``/``detach_storage``).
    Detaching drops the storage nodes from the tree; the files stay in the directory, and a
    later write of the same key is skipped, since a key names its content: the hash covers a
    namespace (the model's identity), the segment's start and every token up to its end."""

    def __init__(self, kv: KVPool, host_tokens: int, namespace: str) -> None:
        if host_tokens <= 0:
            raise ValueError("HiCache needs a host tier of at least one token")
        layers, _, heads, dim = kv.k.shape
        pin = kv.k.device.type == "cuda"  # page-locked host memory makes the copies async-capable
        self.kv = kv
        self.host = KVPool(layers, host_tokens, heads, dim, kv.k.dtype, "cpu", pin_memory=pin)
        self.storage: FileStorage | NoStorage = NoStorage()
        self.model_namespace = namespace  # the model's identity
        self.namespace = namespace  # what keys hash: the model's identity, then its weights'
        self.cache: RadixCache | None = None
        self._host_nodes: set[RadixNode] = set()
        self._seq = itertools.count()
        # Running totals, for logs and tests.
        self.tokens_demoted = 0
        self.tokens_written = 0
        self.tokens_loaded_host = 0
        self.tokens_loaded_storage = 0

    def bind(self, cache: RadixCache) -> None:
        self.cache = cache

    @property
    def storage_backend(self) -> str | None:
        return self.storage.backend

    # --- storage attach / detach -----------------------------------------------------------

    def attach_storage(self, backend: str, directory: str) -> None:
        """Raises StorageError (nothing changes) when the backend or directory is unusable,
        or when another storage is attached. Attaching the attached one again is a no-op."""
        if backend not in STORAGE_BACKENDS:
            raise StorageError(
                f"unknown storage backend {backend!r};"
                f" this server supports: {', '.join(STORAGE_BACKENDS)}",
                "backend",
            )
        if self.storage.attached:
            if self.storage.backend == backend and str(self.storage.dir) == directory:
                return
            raise StorageError(
                f"storage is already attached ({self.storage.backend} at {self.storage.dir}):"
                " detach it first",
                "dir",
            )
        self.storage = FileStorage(directory)
        logger.info(
            "HiCache storage attached: %s at %s (%d stored segments)",
            backend,
            directory,
            len(self.storage.index),
        )

    def detach_storage(self) -> None:
        """Drops every storage node from the tree (their files stay on disk)."""
        if not self.storage.attached:
            return
        cache = self._cache()
        dropped = 0
        stack = cache.top_nodes()
        while stack:
            node = stack.pop()
            if node.value is None and node.host_value is None:
                dropped += 1
                cache.remove_subtree(node)  # a storage node has only storage nodes below
            else:
                stack.extend(node.children.values())
        logger.info(
            "HiCache storage detached (%s at %s); %d stored prefixes dropped from the tree",
            self.storage.backend,
            self.storage.dir,
            dropped,
        )
        self.storage = NoStorage()

    # --- LowerTiers: what the radix tree calls ---------------------------------------------

    def demote(self, node: RadixNode) -> bool:
        n = len(node)
        assert node.value is not None
        slots = node.value.to(self.kv.k.device)
        if n <= self.host.capacity:
            if self.host.num_free < n:
                self._evict_host(n - self.host.num_free)
            host_slots = self.host.alloc(n)
            assert host_slots is not None, "host eviction left too few slots"
            self.host.k[:, host_slots] = self.kv.k[:, slots].to("cpu")
            self.host.v[:, host_slots] = self.kv.v[:, slots].to("cpu")
            node.host_value = host_slots
            self._host_nodes.add(node)
            self.tokens_demoted += n
            return True
        # Larger than the whole host pool: straight to storage, if there is one.
        return self._write_storage(node, self.kv.k[:, slots], self.kv.v[:, slots])

    def release(self, node: RadixNode) -> None:
        if node.host_value is not None:
            self.host.free(node.host_value)
            node.host_value = None
            self._host_nodes.discard(node)
        node.storage = None

    def on_split(self, head: RadixNode, tail: RadixNode, at: int) -> None:
        if tail.host_value is not None:
            head.host_value = tail.host_value[:at]
            tail.host_value = tail.host_value[at:]
            self._host_nodes.add(head)
        ref = tail.storage
        if ref is not None:
            head.storage = StorageRef(ref.key, ref.offset, at)
            tail.storage = StorageRef(ref.key, ref.offset + at, ref.length - at)

    # --- host eviction ---------------------------------------------------------------------

    @staticmethod
    def _is_host_leaf(node: RadixNode) -> bool:
        return node.host_value is not None and all(
            c.host_value is None for c in node.children.values()
        )

    def _evict_host(self, num_tokens: int) -> None:
        """Frees at least num_tokens host slots, least recently used host leaves first:
        each goes to storage when it is attached, and out of the tree otherwise. One pass
        over the host nodes per call (calls come only when the host pool is full)."""
        heap = [
            (n.last_access, next(self._seq), n) for n in self._host_nodes if self._is_host_leaf(n)
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if node not in self._host_nodes or not self._is_host_leaf(node):
                continue
            parent = node.parent
            freed += len(node)
            self._host_to_storage(node)
            if parent is not None and parent in self._host_nodes and self._is_host_leaf(parent):
                heapq.heappush(heap, (parent.last_access, next(self._seq), parent))

    def _host_to_storage(self, node: RadixNode) -> None:
        hv = node.host_value
        assert hv is not None
        if self._write_storage(node, self.host.k[:, hv], self.host.v[:, hv]):
            events = self._cache().events
            events.removed(node, MEDIUM_CPU)
            self.host.free(hv)
            node.host_value = None
            self._host_nodes.discard(node)
            events.stored(node, MEDIUM_STORAGE)
        else:
            self._cache().remove_subtree(node)  # frees its host slots (and its subtree's)

    def _write_storage(self, node: RadixNode, k: torch.Tensor, v: torch.Tensor) -> bool:
        if not self.storage.attached:  # before hashing the key
            return False
        key, start = self._key_of(node)
        if not self.storage.put(key, k, v):
            return False
        node.storage = StorageRef(key, 0, len(node))
        self.tokens_written += len(node)
        return True

    def _key_of(self, node: RadixNode) -> tuple[str, int]:
        """The storage key of node's segment: a hash of the namespace (the model's, and the
        tree's: a salted or adapter prefix never names another namespace's file), the
        segment's start and every token from the root through the segment's end."""
        parts: list[np.ndarray] = []
        n: RadixNode | None = node
        while not isinstance(n, RadixRoot):
            assert n is not None, "a node in the tree has a root above it"
            parts.append(n.key)
            n = n.parent
        start = sum(len(p) for p in parts[1:])
        h = hashlib.sha256(self.namespace.encode())
        lora = n.namespace.lora
        # Length-prefixed, so no salt or adapter can pose as another's start. An adapter by
        # name and directory, as vLLM's block hashes: its load id is this process's alone.
        for tag, value in (
            (b"salt", n.namespace.salt),
            (b"lora", None if lora is None else f"{len(lora.name)}:{lora.name}{lora.path}"),
        ):
            if value is not None:
                data = value.encode()
                h.update(tag + len(data).to_bytes(8, "little") + data)
        h.update(start.to_bytes(8, "little"))
        for part in reversed(parts):
            h.update(np.ascontiguousarray(part, dtype="<i8").tobytes())
        return h.hexdigest(), start

    def new_weights(self, tag: str) -> None:
        """New weights are served: keys from now on hash ``tag`` in, so a stored segment of
        the old weights (a key names its content, and a write of a known key is skipped)
        is never read back as the new weights' KV."""
        self.namespace = f"{self.model_namespace}|weights={tag}"

    # --- bringing a prefix back ------------------------------------------------------------

    def match_below(self, node: RadixNode, token_ids: list[int], pos: int) -> list[RadixNode]:
        """The off-device nodes that continue a device match ending at ``node`` (``pos``
        tokens of ``token_ids`` matched), split so that the last one ends where the match
        does. Touches their LRU time."""
        cache = self._cache()
        path: list[RadixNode] = []
        if pos >= len(token_ids):
            return path
        key = np.asarray(token_ids[pos:], dtype=np.int64)
        stamp = next(cache._clock)
        at = 0
        while at < len(key):
            child = node.children.get(int(key[at]))
            if child is None:
                break
            assert child.value is None, "a device node below the end of a device match"
            common = common_prefix_len(child.key, key[at:])
            if common < len(child.key):
                child = cache._split(child, common)
            child.last_access = stamp
            path.append(child)
            node = child
            at += common
        return path

    def fetch(self, path: list[RadixNode]) -> Fetched:
        """Takes the K/V of ``path`` (from ``match_below``) out of the host pool and the
        storage files. A storage segment that cannot be read ends the fetch there, and it
        and everything below it leave the tree. The fetched nodes hold no tier until
        ``install``."""
        out = Fetched()
        files: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for node in path:
            n = len(node)
            hv = node.host_value
            if hv is not None:
                k, v = self.host.k[:, hv], self.host.v[:, hv]  # advanced indexing: copies
                self._cache().events.removed(node, MEDIUM_CPU)
                self.release(node)
                out.host_tokens += n
            else:
                ref: StorageRef | None = node.storage
                data = None
                if ref is not None:
                    started = time.perf_counter()
                    data = files.get(ref.key)
                    if data is None:
                        data = self.storage.get(ref.key)
                    out.storage_seconds += time.perf_counter() - started
                if ref is None or data is None or data[0].shape[1] < ref.offset + ref.length:
                    self._cache().remove_subtree(node)
                    break
                files[ref.key] = data
                k = data[0][:, ref.offset : ref.offset + n]
                v = data[1][:, ref.offset : ref.offset + n]
                self._cache().events.removed(node, MEDIUM_STORAGE)
                node.storage = None
                out.storage_tokens += n
            out.nodes.append(node)
            out.k.append(k)
            out.v.append(v)
        self.tokens_loaded_host += out.host_tokens
        self.tokens_loaded_storage += out.storage_tokens
        return out

    def install(self, fetched: Fetched, slots: torch.Tensor) -> RadixNode:
        """Copies fetched K/V into device ``slots`` and puts its nodes back on the device;
        returns the deepest one (for the request to lock)."""
        cache = self._cache()
        device = self.kv.k.device
        off = 0
        for node, k, v in zip(fetched.nodes, fetched.k, fetched.v):
            n = len(node)
            dst = slots[off : off + n]
            idx = dst.to(device)
            self.kv.k[:, idx] = k.to(device=device, dtype=self.kv.k.dtype)
            self.kv.v[:, idx] = v.to(device=device, dtype=self.kv.v.dtype)
            cache.adopt(node, dst)
            off += n
        return fetched.nodes[-1]

    # --- introspection ---------------------------------------------------------------------

    def apply_storage_control(self, msg: HiCacheStorageControl) -> HiCacheStorageState:
        """Carries out one attach/detach; the answer tells the storage attached afterwards."""
        error: StorageError | None = None
        if msg.attach:
            try:
                self.attach_storage(msg.backend, msg.dir)
            except StorageError as exc:
                error = exc
        else:
            self.detach_storage()
        return storage_state(msg.control_id, self.storage, error)

    @property
    def host_used_tokens(self) -> int:
        return self.host.num_used

    @property
    def host_capacity(self) -> int:
        return self.host.capacity

    def tier_sizes(self) -> dict[str, int]:
        """Tokens the tree holds per tier, from a walk of the tree (tests, debugging)."""
        sizes = {"device": 0, "host": 0, "storage": 0}
        stack = self._cache().top_nodes()
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            tier = (
                "device"
                if node.value is not None
                else "host"
                if node.host_value is not None
                else "storage"
            )
            sizes[tier] += len(node)
        return sizes

    def check_invariants(self) -> None:
        """Each node in exactly one tier; tiers only get lower going down the tree; the
        host pool's used slots are exactly the host nodes'."""
        rank = {"device": 0, "host": 1, "storage": 2}
        host_used = host_nodes = 0
        stack = [(c, 0) for c in self._cache().top_nodes()]
        while stack:
            node, parent_rank = stack.pop()
            tiers = [node.value is not None, node.host_value is not None, node.storage is not None]
            assert sum(tiers) == 1, f"{node} is in {sum(tiers)} tiers"
            r = tiers.index(True)
            assert r >= parent_rank, f"{node} is in a higher tier than its parent"
            assert (node in self._host_nodes) == (r == rank["host"])
            if r == rank["storage"]:
                assert self.storage.attached, "a storage node while no storage is attached"
            if node.host_value is not None:
                assert node.host_value.numel() == len(node)
                host_used += len(node)
                host_nodes += 1
            stack.extend((c, r) for c in node.children.values())
        assert host_used == self.host.num_used, (host_used, self.host.num_used)
        assert host_nodes == len(self._host_nodes), "the host node set disagrees with the tree"

    def _cache(self) -> RadixCache:
        assert self.cache is not None, "HiCache.bind(cache) first"
        return self.cache


class NoHiCache(DeviceOnly):
    """HiCache off: no tier below the device, so a prefix match never continues below it,
    the host tier holds nothing, and a storage attach or detach is refused."""

    storage_backend: str | None = None
    host_used_tokens = 0
    host_capacity = 0

    def apply_storage_control(self, msg: HiCacheStorageControl) -> HiCacheStorageState:
        return storage_state(msg.control_id, NoStorage(), StorageError(HICACHE_OFF))

    def bind(self, cache: RadixCache) -> None:
        pass

    def new_weights(self, tag: str) -> None:
        pass

    def match_below(self, node: RadixNode, token_ids: list[int], pos: int) -> list[RadixNode]:
        return []

    def fetch(self, path: list[RadixNode]) -> Fetched:
        raise AssertionError("nothing to fetch: HiCache is off")

    def install(self, fetched: Fetched, slots: torch.Tensor) -> RadixNode:
        raise AssertionError("nothing to install: HiCache is off")
