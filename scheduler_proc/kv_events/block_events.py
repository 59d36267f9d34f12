"""The radix tree's contents as vLLM's block events. The tree is token-granular; the events
speak of full blocks of ``block_size`` tokens along each cached prefix. A block belongs to
the node that holds its last token, so a node announces its blocks when its tokens enter a
tier (``stored``) and withdraws them when they leave one (``removed``); a split shares them
between the halves and announces nothing, since nothing cached changed.
"""

from __future__ import annotations

import time

from pipeline.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEventKind,
    KVEventBatch,
    MEDIUM_GPU,
)
from scheduler_proc.cache.radix_node import CacheNamespace, RadixNode, RadixRoot, lower_medium
from scheduler_proc.kv_events.block_hashes import BlockHasher, event_extra_keys, external_hash


class BlockEvents:
    """A ``CacheEvents`` that turns the tree's changes into events, kept until ``take``."""

    def __init__(self, hasher: BlockHasher) -> None:
        self.hasher = hasher
        self.block_size = hasher.block_size
        self._pending: list[KVCacheEventKind] = []

    def take(self) -> KVEventBatch | None:
        """The events since the last call, as one batch (None: there were none)."""
        if not self._pending:
            return None
        events, self._pending = self._pending, []
        return KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=0)

    # --- CacheEvents ---------------------------------------------------------------------

    def stored(self, node: RadixNode, medium: str) -> None:
        start, parent_hash, head, namespace = self._above(node)
        hashes = self._hashes(node, start, parent_hash, head, namespace)
        if not hashes:
            return
        size = self.block_size
        first = start // size
        tokens = (head + node.key.tolist())[: len(hashes) * size]
        extra = [event_extra_keys(namespace, first + i) for i in range(len(hashes))]
        lora = namespace.lora
        self._pending.append(
            BlockStored(
                block_hashes=[external_hash(h) for h in hashes],
                parent_block_hash=None if parent_hash is None else external_hash(parent_hash),
                token_ids=tokens,
                block_size=size,
                lora_id=None if lora is None else lora.id,
                medium=medium,
                lora_name=None if lora is None else lora.name,
                extra_keys=extra,
            )
        )

    def removed(self, node: RadixNode, medium: str) -> None:
        if node.block_hashes:
            hashes: list[bytes | int] = [external_hash(h) for h in node.block_hashes]
            self._pending.append(BlockRemoved(block_hashes=hashes, medium=medium))

    def split(self, head: RadixNode, tail: RadixNode, at: int) -> None:
        hashes = tail.block_hashes
        if hashes is None:
            return
        start = _start_of(head)
        size = self.block_size
        in_head = (start + at) // size - start // size
        head.block_hashes, tail.block_hashes = hashes[:in_head], hashes[in_head:]

    def cleared(self, top_nodes: list[RadixNode]) -> None:
        """The tree was flushed: what requests still hold (locked prefixes) stays, and is
        announced again after the clear, so an index built from the events stays exact."""
        self._pending.append(AllBlocksCleared())
        stack = list(top_nodes)
        while stack:
            node = stack.pop()
            medium = MEDIUM_GPU if node.value is not None else lower_medium(node)
            if medium is not None:
                self.stored(node, medium)
            stack.extend(node.children.values())

    # --- hashing -------------------------------------------------------------------------

    def _above(self, node: RadixNode) -> tuple[int, bytes | None, list[int], CacheNamespace]:
        """Where node starts in its prefix, the hash of the last full block before it (None
        when there is none), the tokens of the partial block it continues, and its
        namespace: from one walk up to the root."""
        ancestors: list[RadixNode] = []  # the nearest first
        at = node.parent
        while not isinstance(at, RadixRoot):
            assert at is not None, "a node in the tree has a root above it"
            ancestors.append(at)
            at = at.parent
        start = sum(len(a) for a in ancestors)
        need = start % self.block_size  # the head of node's first block lies above it
        head: list[int] = []
        for a in ancestors:
            if len(head) >= need:
                break
            head = a.key[-(need - len(head)) :].tolist() + head
        # The last full block before node belongs to the nearest ancestor that holds one.
        parent_hash = next((h[-1] for a in ancestors if (h := self._hashes_of(a))), None)
        return start, parent_hash, head, at.namespace

    def _hashes(
        self,
        node: RadixNode,
        start: int,
        parent_hash: bytes | None,
        head: list[int],
        namespace: CacheNamespace,
    ) -> list[bytes]:
        if node.block_hashes is None:
            size = self.block_size
            end = start + len(node)
            count = end // size - start // size
            tokens = (head + node.key.tolist())[: count * size]
            node.block_hashes = self.hasher.chain(parent_hash, tokens, start // size, namespace)
        return node.block_hashes

    def _hashes_of(self, node: RadixNode) -> list[bytes]:
        """node's block hashes, computed now if no event has yet (they always have)."""
        if node.block_hashes is None:
            self._hashes(node, *self._above(node))
        assert node.block_hashes is not None
        return node.block_hashes


def _start_of(node: RadixNode) -> int:
    """The tokens above node in its prefix."""
    start = 0
    at = node.parent
    while at is not None:
        start += len(at)
        at = at.parent
    return start
