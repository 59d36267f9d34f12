"""What watches the radix tree's contents: ``CacheEvents``, told of every change of what the
tree caches where (KV cache events, ``scheduler_proc.kv_events``), or ``NoCacheEvents``."""

from __future__ import annotations

from typing import Protocol

from scheduler_proc.cache.radix_node import RadixNode


class CacheEvents(Protocol):
    """What watches the tree's contents (``scheduler_proc.kv_events``): told when a node's
    tokens are stored in or removed from a tier (``medium``: the names of
    ``pipeline/kv_events.py``), when a node splits, and when the tree is flushed."""

    def stored(self, node: RadixNode, medium: str) -> None: ...

    def removed(self, node: RadixNode, medium: str) -> None: ...

    def split(self, head: RadixNode, tail: RadixNode, at: int) -> None: ...

    def cleared(self, top_nodes: list[RadixNode]) -> None:
        """The tree was flushed; ``top_nodes`` (``RadixCache.top_nodes``) hold what stays."""


class NoCacheEvents:
    """Nobody watches (KV cache events off)."""

    def stored(self, node: RadixNode, medium: str) -> None:
        pass

    def removed(self, node: RadixNode, medium: str) -> None:
        pass

    def split(self, head: RadixNode, tail: RadixNode, at: int) -> None:
        pass

    def cleared(self, top_nodes: list[RadixNode]) -> None:
        pass
