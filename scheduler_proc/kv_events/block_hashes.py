"""Block hashes as vLLM computes them (its ``sha256_cbor`` prefix-cache hashing), so that a
router that hashes a prompt's blocks itself finds the ones our events announce: block ``i``'s
hash is sha256 of the canonical CBOR of (block ``i - 1``'s hash, the block's token ids, its
extra keys), block 0's parent being ``NONE_HASH``, the hash of the seed (``PYTHONHASHSEED``,
else vLLM's fixed default). An adapter's ``("lora", name, path)`` is an extra key of every
block, and the cache salt one of a prefix's first block, in that order, as vLLM's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import cbor2

from scheduler_proc.cache.radix_node import CacheNamespace

# vLLM's seed of NONE_HASH when PYTHONHASHSEED is not set (its cryptographic hashes).
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"

_LOW_64_BITS = (1 << 64) - 1


def sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def external_hash(digest: bytes) -> int:
    """What an event carries for a block hash: vLLM's default (the digest's low 64 bits)."""
    return int.from_bytes(digest, "big") & _LOW_64_BITS


class BlockHasher:
    """Hashes full blocks of ``block_size`` tokens, chained from ``NONE_HASH``."""

    def __init__(self, block_size: int, seed: str | None) -> None:
        self.block_size = block_size
        self.none_hash = sha256_cbor(DEFAULT_NONE_HASH_SEED if seed is None else seed)

    def chain(
        self,
        parent: bytes | None,
        tokens: Sequence[int],
        first_block: int,
        namespace: CacheNamespace,
    ) -> list[bytes]:
        """The hashes of the full blocks in ``tokens`` (a whole number of blocks), which
        start at block ``first_block`` of their prefix, after the block hashed ``parent``
        (None: they start the prefix)."""
        size = self.block_size
        hashes: list[bytes] = []
        previous = self.none_hash if parent is None else parent
        for i in range(0, len(tokens), size):
            block = first_block + i // size
            extra = hash_extra_keys(namespace, block)
            previous = sha256_cbor((previous, tuple(tokens[i : i + size]), extra))
            hashes.append(previous)
        return hashes


def hash_extra_keys(namespace: CacheNamespace, block: int) -> tuple[Any, ...] | None:
    """Block ``block``'s extra keys in its hash, each tagged with its source."""
    keys: list[tuple[str, ...]] = []
    if namespace.lora is not None:
        keys.append(("lora", namespace.lora.name, namespace.lora.path))
    if block == 0 and namespace.salt is not None:
        keys.append(("cache_salt", namespace.salt))
    return tuple(keys) or None


def event_extra_keys(namespace: CacheNamespace, block: int) -> tuple[Any, ...] | None:
    """The same keys as an event publishes them, untagged: the adapter's name, the salt."""
    keys = hash_extra_keys(namespace, block)
    return None if keys is None else tuple(key[1] for key in keys)
