"""Radix-tree prefix cache over token ids, sharing the KV pool's slots. Invariants:
- Every slot the tree holds is allocated in the pool and held by exactly one node; the tree
  frees a slot only when it evicts (or drops as a duplicate on insert) what it owns.
- A node's lock_ref counts the locks taken on it or on any descendant, so "locked" is a
  per-node check and ancestors of a locked node are never evicted out from under it.
- A split keeps the original node object as the deeper half: references requests hold
  (locked nodes) keep pointing at the node that ends where their match ended.
- Eviction pops a lazily invalidated heap: an entry is stale when its node was removed,
  gained children, got locked or was touched since the push. No scan per evicted node.
- The device nodes form a subtree that hangs from the root (nodes below a tier: ``LowerTiers``).
- One root per ``CacheNamespace``: prefixes of different namespaces never share a node.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import NamedTuple, Protocol

import numpy as np
import torch

from pipeline.kv_events import MEDIUM_GPU
from scheduler_proc.cache.cache_events import CacheEvents, NoCacheEvents
from scheduler_proc.cache.kv_pool import KVPool
from scheduler_proc.cache.radix_node import (
    UNSALTED,
    CacheNamespace,
    RadixNode,
    RadixRoot,
    common_prefix_len,
    empty_slots,
    lower_medium,
)


class Dropped(NamedTuple):
    """Tokens that ``RadixCache.drop_unlocked`` took out of the tree, per tier."""

    device: int
    host: int
    storage: int


class LowerTiers(Protocol):
    """Where evicted device KV goes: ``scheduler_proc.cache.hicache.HiCache``, or
    ``DeviceOnly`` (none). With HiCache an evicted node may stay in the tree off the device
    (``value`` None), its KV kept in a host pool or a storage file that the lower tiers own
    (``host_value``, ``storage``). An off-device node has only off-device descendants, so a
    device match is a walk that stops at the first off-device node, and "leaf" means "no
    device child". The tree's sizes count device slots only. With ``DeviceOnly`` every node
    is on the device and all of this is moot."""

    def demote(self, node: RadixNode) -> bool:
        """Copies an evicted device node's KV below the device; True when the node stays
        in the tree (off the device), False when it must be dropped."""
        ...

    def release(self, node: RadixNode) -> None:
        """Forgets node's lower-tier copy (it is dropped, or back on the device)."""
        ...

    def on_split(self, head: RadixNode, tail: RadixNode, at: int) -> None:
        """A node was split at ``at``: share its lower-tier holdings between the halves."""
        ...


class DeviceOnly:
    """No tier below the device (HiCache off): an evicted node leaves the tree."""

    def demote(self, node: RadixNode) -> bool:
        return False

    def release(self, node: RadixNode) -> None:
        pass

    def on_split(self, head: RadixNode, tail: RadixNode, at: int) -> None:
        pass


class RadixCache:
    def __init__(
        self, kv: KVPool, lower: LowerTiers | None = None, events: CacheEvents | None = None
    ) -> None:
        self.kv = kv
        self.lower: LowerTiers = lower or DeviceOnly()
        self.events: CacheEvents = events or NoCacheEvents()
        self._clock = itertools.count(1)  # LRU time: a counter is enough and never ties by accident
        self._seq = itertools.count()  # heap tie-break, so nodes are never compared
        self._heap: list[tuple[float, int, RadixNode]] = []
        self._num_nodes = 0
        self._evictable = 0
        self._protected = 0
        self.root = RadixRoot(UNSALTED)  # the unsalted namespace's
        self._roots: dict[CacheNamespace, RadixRoot] = {UNSALTED: self.root}

    # --- sizes ---------------------------------------------------------------------------

    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    @property
    def total_size(self) -> int:
        return self._evictable + self._protected

    def roots(self) -> list[RadixRoot]:
        """Every namespace's root (the unsalted one first)."""
        return list(self._roots.values())

    def top_nodes(self) -> list[RadixNode]:
        """The nodes right below every namespace's root: where a walk of the tree starts."""
        return [child for root in self._roots.values() for child in root.children.values()]

    def _root(self, namespace: CacheNamespace) -> RadixRoot:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = RadixRoot(namespace)
        return root

    def _forget_if_empty(self, node: RadixNode) -> None:
        """A salted namespace whose last node went leaves no root behind (salts are many)."""
        if isinstance(node, RadixRoot) and not node.children and node is not self.root:
            if self._roots.get(node.namespace) is node:
                del self._roots[node.namespace]

    # --- lookup --------------------------------------------------------------------------

    def match_prefix(
        self, token_ids: Sequence[int], namespace: CacheNamespace = UNSALTED
    ) -> tuple[torch.Tensor, RadixNode]:
        """Longest cached prefix of token_ids in ``namespace``: (its slots as one LongTensor,
        the deepest node of the match). Splits a node when the match ends inside it, so the
        returned node covers exactly the match and can be locked. Touches LRU time along the
        path. Empty match -> (empty LongTensor, the namespace's root)."""
        key = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        now = next(self._clock)
        # A namespace with nothing cached gets a root only when something is inserted.
        root = self._roots.get(namespace)  # not `or`: a node's truth is its length
        node: RadixNode = RadixRoot(namespace) if root is None else root
        values: list[torch.Tensor] = []
        pos = 0
        while pos < len(key):
            child = node.children.get(int(key[pos]))
            if child is None or child.value is None:
                break  # a lower tier's node: HiCache continues the match from here
            common = common_prefix_len(child.key, key[pos:])
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            assert (
                child.value is not None
            )  # a split of a device node keeps both halves on the device
            values.append(child.value)
            node = child
            # After a split the next lookup misses (the tail starts with another token),
            # so the loop ends here without a separate check.
            pos += common
        self._push_if_evictable(node)
        if not values:
            return empty_slots(), node
        # clone the single-node case too: callers must never hold a view of a node's slots.
        return (values[0].clone() if len(values) == 1 else torch.cat(values)), node

    # --- locking -------------------------------------------------------------------------

    def inc_lock(self, node: RadixNode) -> None:
        """Protects node and all its ancestors from eviction (ref counted)."""
        self._check_live(node)
        while not isinstance(node, RadixRoot):
            if node.lock_ref == 0:
                self._evictable -= len(node)
                self._protected += len(node)
            node.lock_ref += 1
            parent = node.parent
            assert parent is not None  # _check_live: ancestors of a live node are live
            node = parent

    def dec_lock(self, node: RadixNode) -> None:
        self._check_live(node)
        leaf = node
        while not isinstance(node, RadixRoot):
            if node.lock_ref <= 0:
                raise RuntimeError("RadixCache.dec_lock without a matching inc_lock")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node)
                self._evictable += len(node)
            parent = node.parent
            assert parent is not None  # _check_live: ancestors of a live node are live
            node = parent
        # Only the bottom of the path can be a leaf: every node above it has a child.
        self._push_if_evictable(leaf)

    # --- insertion -----------------------------------------------------------------------

    def insert(
        self, token_ids: Sequence[int], slots: torch.Tensor, namespace: CacheNamespace = UNSALTED
    ) -> int:
        """Caches token_ids -> slots (same length) in ``namespace``. The tree takes ownership
        of the slots of the part it did not already hold. Returns the length of the prefix
        that was ALREADY cached; the caller's slots for that prefix are duplicates and are
        freed here, except those that are the tree's own slots (a request that matched its
        prefix from the cache holds them)."""
        key = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        slots = slots.reshape(-1).to(device="cpu", dtype=torch.long)
        if len(key) != slots.numel():
            raise ValueError(f"insert: {len(key)} token ids but {slots.numel()} slots")
        now = next(self._clock)
        node: RadixNode = self._root(namespace)
        duplicates: list[torch.Tensor] = []
        pos = 0
        while pos < len(key):
            child = node.children.get(int(key[pos]))
            if child is None:
                break
            common = common_prefix_len(child.key, key[pos:])
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            theirs = slots[pos : pos + common]
            if child.value is None:
                # Cached only in a lower tier: the caller computed it again, so the tree
                # takes the caller's slots and drops the lower copy.
                self.adopt(child, theirs)
            else:
                duplicates.append(theirs[theirs != child.value])
            node = child
            pos += common
        if pos < len(key):
            # clone: the caller's tensor may be a view of a larger one it keeps using.
            leaf = RadixNode(key[pos:].copy(), slots[pos:].clone(), node, now)
            node.children[int(key[pos])] = leaf
            self._num_nodes += 1
            # A new leaf starts unlocked even under a locked parent: the locks protect the
            # requests' own paths, not what other requests add below them.
            self._evictable += len(leaf)
            self._push_if_evictable(leaf)
            self.events.stored(leaf, MEDIUM_GPU)
        else:
            self._push_if_evictable(node)
        if duplicates:
            dup = duplicates[0] if len(duplicates) == 1 else torch.cat(duplicates)
            if dup.numel():
                self.kv.free(dup)
        return pos

    def adopt(self, node: RadixNode, slots: torch.Tensor) -> None:
        """Puts an off-device node back on the device at ``slots`` (the tree takes them).
        Its parent must be on the device already, which keeps the device subtree whole."""
        assert node.value is None and node.lock_ref == 0 and node.parent is not None
        assert node.parent.value is not None  # a root's value is its empty slots
        assert slots.numel() == len(node)
        lower = lower_medium(node)
        if lower is not None:
            self.events.removed(node, lower)
        node.value = slots.clone()
        self.lower.release(node)
        self._evictable += len(node)
        self._push_if_evictable(node)
        self.events.stored(node, MEDIUM_GPU)

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Splits child's run at `at` (0 < at < len): a new node takes the head and becomes
        child's parent; child keeps the tail, so references to child stay valid."""
        assert 0 < at < len(child.key) and child.parent is not None
        parent = child.parent
        value = child.value
        head = RadixNode(
            child.key[:at], None if value is None else value[:at], parent, child.last_access
        )
        # Every lock on child also passes through head, so head inherits the count; the
        # evictable/protected totals do not change since the tokens are the same.
        head.lock_ref = child.lock_ref
        head.children[int(child.key[at])] = child
        parent.children[int(child.key[0])] = head
        child.key = child.key[at:]
        child.value = None if value is None else value[at:]
        child.parent = head
        self._num_nodes += 1
        self.lower.on_split(head, child, at)
        self.events.split(head, child, at)
        return head

    # --- eviction ------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Frees at least num_tokens slots (if possible) by removing least-recently-used
        unlocked leaves; a parent becomes a candidate once its children are gone. With
        lower tiers an evicted leaf moves down instead of going, when they take it. Returns
        how many slots were freed."""
        freed: list[torch.Tensor] = []
        count = 0
        while count < num_tokens and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if not self._is_evictable_leaf(node) or node.last_access != stamp:
                continue  # stale entry; a fresh one was pushed when the node changed
            parent = node.parent
            assert parent is not None and node.value is not None
            self._evictable -= len(node)
            count += len(node)
            freed.append(node.value)
            self.events.removed(node, MEDIUM_GPU)
            if self.lower.demote(node):
                node.value = None  # stays in the tree, its KV one tier down
                medium = lower_medium(node)
                assert medium is not None, "demote keeps a node in a lower tier"
                self.events.stored(node, medium)
            else:
                node.value = None
                self.remove_subtree(node)
            self._push_if_evictable(parent)
        if freed:
            self.kv.free(freed[0] if len(freed) == 1 else torch.cat(freed))
        return count

    def remove_subtree(self, node: RadixNode, *, announce: bool = True) -> None:
        """Takes an off-device node and everything below it out of the tree, releasing
        their lower-tier copies (device nodes are never below an off-device one), and with
        ``announce`` tells the events of each copy that goes."""
        assert node.value is None and node.parent is not None
        parent = node.parent
        del parent.children[int(node.key[0])]
        stack = [node]
        while stack:
            n = stack.pop()
            assert n.value is None and n.lock_ref == 0
            stack.extend(n.children.values())
            medium = lower_medium(n)
            if announce and medium is not None:
                self.events.removed(n, medium)
            self.lower.release(n)
            n.parent = None
            self._num_nodes -= 1
        self._forget_if_empty(parent)

    def drop_unlocked(self) -> Dropped:
        """Takes every unlocked node out of the tree, whatever its tier: device slots go back
        to the pool and lower-tier copies are released. Locked paths stay, slots and all: a
        request reads them (a node's lock_ref counts its descendants' locks, so an unlocked
        node has no locked node below it and its whole subtree can go)."""
        device = host = storage = 0
        freed: list[torch.Tensor] = []
        stack: list[RadixNode] = list(self.roots())
        while stack:
            for child in list(stack.pop().children.values()):
                if child.lock_ref > 0:
                    stack.append(child)
                    continue
                for node in _subtree(child):
                    if node.value is not None:
                        device += len(node)
                        freed.append(node.value)
                        node.value = None
                    elif node.host_value is not None:
                        host += len(node)
                    else:
                        storage += len(node)
                self.remove_subtree(child, announce=False)  # one "cleared" says it all
        self.events.cleared(self.top_nodes())
        self._evictable -= device
        if freed:
            self.kv.free(torch.cat(freed))
        # Entries of removed nodes are stale already; dropping them keeps the heap small.
        self._heap = [entry for entry in self._heap if self._is_evictable_leaf(entry[2])]
        heapq.heapify(self._heap)
        return Dropped(device, host, storage)

    def reset(self) -> None:
        """Frees everything unlocked (debug/tests). Locked paths survive."""
        self.evict(self._evictable)
        assert self._evictable == 0, "reset left unlocked nodes behind"
        self._heap = []

    def _check_live(self, node: RadixNode) -> None:
        if node.parent is None and not isinstance(node, RadixRoot):
            raise RuntimeError("RadixCache: lock change on a node that was evicted")

    def _is_evictable_leaf(self, node: RadixNode) -> bool:
        """An unlocked device node with no device child."""
        if node.parent is None or node.lock_ref != 0 or node.value is None:
            return False
        return not node.children or all(c.value is None for c in node.children.values())

    def _push_if_evictable(self, node: RadixNode) -> None:
        if self._is_evictable_leaf(node):
            heapq.heappush(self._heap, (node.last_access, next(self._seq), node))
            self._maybe_compact_heap()

    def _maybe_compact_heap(self) -> None:
        # Touches and lock cycles leave stale entries behind; rebuild once they dominate so
        # the heap stays O(nodes). Amortised: at most one scan per ~num_nodes pushes.
        if len(self._heap) <= 2 * self._num_nodes + 64:
            return
        live: list[tuple[float, int, RadixNode]] = []
        stack = self.top_nodes()
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            if self._is_evictable_leaf(node):
                live.append((node.last_access, next(self._seq), node))
        heapq.heapify(live)
        self._heap = live


def _subtree(node: RadixNode) -> Iterator[RadixNode]:
    stack = [node]
    while stack:
        n = stack.pop()
        stack.extend(n.children.values())
        yield n
