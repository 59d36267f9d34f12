"""A request's KV slots and its cached prefix: the device pool, the radix cache over it
and, when HiCache is on, the host and storage tiers under it. The scheduler decides who
runs; this class decides where each request's KV comes from and where it goes, and is
the only code that touches the tree.

A request's prefix is locked in the tree (``Req.prefix_node``) from its admission until
its KV is released, so eviction never takes slots a request reads.
"""

from __future__ import annotations

import torch

from scheduler_proc.cache.hicache import Fetched, HiCache, NoHiCache
from scheduler_proc.cache.kv_pool import KVPool
from scheduler_proc.cache.cache_events import CacheEvents
from scheduler_proc.cache.radix_cache import Dropped, RadixCache
from scheduler_proc.cache.radix_node import CacheNamespace, RadixNode
from scheduler_proc.req import Req


class PrefixKV:
    def __init__(
        self, kv: KVPool, hicache: HiCache | None = None, events: CacheEvents | None = None
    ) -> None:
        self.kv = kv
        self.hicache: HiCache | NoHiCache = hicache or NoHiCache()  # the tiers below the device
        self.cache = RadixCache(kv, lower=self.hicache, events=events)
        self.hicache.bind(self.cache)

    @property
    def storage_backend(self) -> str | None:
        return self.hicache.storage_backend

    def admit(
        self, req: Req, *, match: bool, budget: int, reserve: int
    ) -> tuple[torch.Tensor, Fetched | None] | None:
        """Slots for the next ``<= budget`` tokens of req's (re-)prefill, leaving ``reserve``
        slots for the next decode step; None (and req as it was) when they do not fit.

        With ``match`` (a request leaving the waiting queue) the prefill starts from the
        longest cached prefix: the device part is locked as it is, and HiCache hits below
        it are brought back onto the device first (the returned ``Fetched`` says how many
        tokens came from each tier and how long storage took). The last token is always
        computed, since its logits pick the next token."""
        fill = req.fill_ids
        lower: list[RadixNode] = []
        hicache = self.hicache
        if match:
            key = fill[: min(len(fill) - 1, req.cache_match_limit)]
            cached, node = self.cache.match_prefix(key, namespace_of(req))
            self.cache.inc_lock(node)
            req.prefix_node = node
            req.kv_slots = cached
            req.num_computed = len(cached)
            lower = hicache.match_below(node, key, len(cached))
        to_load = sum(len(node) for node in lower)
        take = min(len(fill) - req.num_computed - to_load, budget)
        if not self.fits(to_load + take, reserve):
            if match:
                self.unlock(req)  # it holds only the cache's own slots so far
            return None
        fetched = None
        if lower:  # only HiCache finds nodes below the device match
            fetched = hicache.fetch(lower)
            # Fewer tokens when a storage file could not be read: compute the rest.
            to_load = fetched.num_tokens
            take = min(len(fill) - req.num_computed - to_load, budget)
        slots = self.alloc(to_load + take)
        assert slots is not None, "fits() promised these slots"
        if to_load and fetched is not None:  # to_load > 0: something was fetched
            held = req.kv_slots
            assert held is not None, "the match above set it"
            node = hicache.install(fetched, slots[:to_load])
            self.cache.inc_lock(node)
            self.cache.dec_lock(locked_node(req))
            req.prefix_node = node
            req.kv_slots = torch.cat((held, slots[:to_load]))
            req.num_computed += to_load
        return slots[to_load:], fetched

    def fits(self, n: int, reserve: int = 0) -> bool:
        """Whether n pool slots can be had (evicting cached prefixes) leaving ``reserve``."""
        return self.kv.num_free + self.cache.evictable_size - n >= reserve

    def alloc(self, n: int, reserve: int = 0) -> torch.Tensor | None:
        """n pool slots, evicting cached prefixes when the free list is short; None when even
        that would leave fewer than ``reserve`` slots for the next decode step."""
        if not self.fits(n, reserve):
            return None
        if self.kv.num_free < n:
            self.cache.evict(n - self.kv.num_free)
        return self.kv.alloc(n)

    def release(self, req: Req, *, cache: bool = True) -> None:
        """Gives up a request's KV: its computed tokens go into the prefix cache, which takes
        the slots (freeing duplicates of what it already held), then the prefix lock drops.
        An embedding request's KV is only freed (it never reads the cache), and so is the
        KV of a ``cache=False`` release (a PD decode request: it never prefills here; a
        request on KV of weights swapped out)."""
        slots = req.kv_slots
        if slots is not None and slots.numel() and (req.is_embedding or not cache):
            # Its own slots only: those of the prefix it locked are the cache's.
            owned = 0 if req.prefix_node is None else prefix_length(locked_node(req))
            self.kv.free(slots[owned:])
        elif slots is not None and slots.numel():
            tokens = (req.origin_input_ids + req.output_ids)[: req.num_computed]
            self.cache.insert(tokens, slots, namespace_of(req))
        self.unlock(req)

    def unlock(self, req: Req) -> None:
        if req.prefix_node is not None:
            self.cache.dec_lock(locked_node(req))
        req.prefix_node = None
        req.kv_slots = None
        req.num_computed = 0

    def flush(self) -> Dropped:
        """Drops the prefix cache on every tier (``/flush_cache``). What requests hold
        (locked prefixes, their own slots) stays."""
        return self.cache.drop_unlocked()

    @property
    def held_by_requests(self) -> int:
        """Device slots that requests hold (not the evictable cache)."""
        return self.kv.num_used - self.cache.evictable_size


def namespace_of(req: Req) -> CacheNamespace:
    """The part of the prefix cache ``req`` reads and fills: its tenant's salt's, under
    its adapter."""
    return CacheNamespace(req.cache_salt, req.lora)


def locked_node(req: Req) -> RadixNode:
    """The tree node ``req`` holds locked (``Req.prefix_node``, which this module sets)."""
    node = req.prefix_node
    assert isinstance(node, RadixNode), f"{req!r} holds no prefix lock"
    return node


def prefix_length(node: RadixNode) -> int:
    """The tokens from the root to the end of ``node``."""
    length = 0
    at: RadixNode | None = node
    while at is not None:
        length += len(at)
        at = at.parent
    return length
