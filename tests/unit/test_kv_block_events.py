"""The radix tree's namespaces (cache salts) and its KV cache events: block hashes as vLLM
computes them (recomputed here from the token ids alone), announced once per block, withdrawn
on eviction, shared correctly across splits, and re-announced after a flush for what requests
still hold; an index built only from the events always equals the tree's full blocks."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import cbor2
import pytest
import torch

from pipeline.config import ServerConfig
from pipeline.control_frames import LoraAdapter
from pipeline.server_args import check_config
from pipeline.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from scheduler_proc.cache.kv_pool import KVPool
from scheduler_proc.cache.radix_cache import RadixCache
from scheduler_proc.cache.radix_node import UNSALTED, CacheNamespace, RadixNode, RadixRoot
from scheduler_proc.kv_events.block_events import BlockEvents
from scheduler_proc.kv_events.block_hashes import BlockHasher
from scheduler_proc.main import build_scheduler
from tests.unit.test_scheduler_steps import run_to_end, submit

BLOCK = 4


def vllm_hashes(
    tokens: list[int],
    salt: str | None = None,
    seed: str = "vllm-none-hash",
    lora: tuple[str, str] | None = None,
) -> list[int]:
    """vLLM's sha256_cbor block hashes of every full block of ``tokens``, as events carry
    them (the low 64 bits), computed without the server's code. ``lora``: the adapter's
    (name, path), an extra key of every block before the salt, as vLLM's."""

    def sha(value: object) -> bytes:
        return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()

    parent = sha(seed)
    out = []
    for b in range(len(tokens) // BLOCK):
        keys: list[tuple[str, ...]] = [("lora", *lora)] if lora is not None else []
        keys += [("cache_salt", salt)] if b == 0 and salt is not None else []
        extra = tuple(keys) or None
        parent = sha((parent, tuple(tokens[b * BLOCK : (b + 1) * BLOCK]), extra))
        out.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return out


def new_cache(capacity: int = 256) -> tuple[RadixCache, BlockEvents]:
    kv = KVPool(1, capacity, 1, 2, torch.float32, "cpu", debug=True)
    events = BlockEvents(BlockHasher(BLOCK, None))
    return RadixCache(kv, events=events), events


def insert(cache: RadixCache, tokens: list[int], ns: CacheNamespace = UNSALTED) -> None:
    held, node = cache.match_prefix(tokens, ns)
    new = cache.kv.alloc(len(tokens) - len(held))
    assert new is not None
    cache.insert(tokens, torch.cat((held, new)), ns)


def take(events: BlockEvents) -> list[object]:
    batch = events.take()
    return [] if batch is None else list(batch.events)


def test_a_prefix_stores_its_full_blocks_once_with_vllm_hashes() -> None:
    cache, events = new_cache()
    tokens = list(range(100, 110))  # 2 full blocks and a partial one
    insert(cache, tokens)
    [stored] = take(events)
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == vllm_hashes(tokens)
    assert stored.parent_block_hash is None and stored.token_ids == tokens[:8]
    assert stored.block_size == BLOCK and stored.medium == "GPU"
    assert stored.extra_keys == [None, None] and stored.lora_id is None
    insert(cache, tokens[:9])  # nothing new
    assert take(events) == []
    # A longer prompt stores only the block its new tokens complete, chained to the last.
    longer = tokens + [7, 7, 7]
    insert(cache, longer)
    [more] = take(events)
    assert isinstance(more, BlockStored)
    assert more.block_hashes == vllm_hashes(longer)[2:]
    assert more.parent_block_hash == vllm_hashes(tokens)[1]
    assert more.token_ids == longer[8:12]


def test_a_split_shares_blocks_and_a_branch_chains_from_the_right_parent() -> None:
    cache, events = new_cache()
    first = list(range(1, 13))  # blocks end at 4, 8, 12
    insert(cache, first)
    take(events)
    branch = first[:6] + [90, 91, 92, 93, 94, 95]  # splits the node at 6
    insert(cache, branch)
    [stored] = take(events)
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == vllm_hashes(branch)[1:]
    assert stored.parent_block_hash == vllm_hashes(first)[0]
    assert stored.token_ids == branch[4:12]
    # Evicting the first prompt's tail withdraws exactly its own blocks (8 and 12), not
    # block 4, which the shared head holds.
    cache.match_prefix(branch)  # the branch is the most recent
    cache.evict(1)
    [removed] = take(events)
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == vllm_hashes(first)[1:] and removed.medium == "GPU"


def test_salted_prefixes_share_nothing_and_hash_the_salt_into_their_first_block() -> None:
    cache, events = new_cache()
    tokens = list(range(30, 39))
    a, b = CacheNamespace("tenant-a"), CacheNamespace("tenant-b")
    insert(cache, tokens, a)
    assert cache.match_prefix(tokens, b)[0].numel() == 0
    assert cache.match_prefix(tokens)[0].numel() == 0  # nor with the unsalted
    assert cache.match_prefix(tokens, a)[0].numel() == len(tokens)
    [stored] = take(events)
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == vllm_hashes(tokens, "tenant-a")
    assert stored.block_hashes != vllm_hashes(tokens)
    assert stored.extra_keys == [("tenant-a",), None]
    # A salt whose last prefix is evicted leaves no root behind; the unsalted root stays.
    cache.evict(len(tokens))
    assert [root.namespace for root in cache.roots()] == [CacheNamespace()]


def test_adapter_prefixes_hash_the_adapter_into_every_block_and_name_it() -> None:
    cache, events = new_cache()
    tokens = list(range(40, 49))
    sql = LoraAdapter(name="sql", path="/adapters/sql", id=3)
    insert(cache, tokens, CacheNamespace("t", sql))
    assert cache.match_prefix(tokens, CacheNamespace("t"))[0].numel() == 0  # the base model
    reloaded = LoraAdapter(name="sql", path="/adapters/sql", id=4)
    assert cache.match_prefix(tokens, CacheNamespace("t", reloaded))[0].numel() == 0
    assert cache.match_prefix(tokens, CacheNamespace("t", sql))[0].numel() == len(tokens)
    [stored] = take(events)
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == vllm_hashes(tokens, "t", lora=("sql", "/adapters/sql"))
    assert stored.block_hashes != vllm_hashes(tokens, "t")
    # Published untagged, as vLLM's events: the adapter's name on every block, then the salt.
    assert stored.extra_keys == [("sql", "t"), ("sql",)]
    assert (stored.lora_name, stored.lora_id) == ("sql", 3)


def test_a_flush_clears_then_announces_what_requests_still_hold() -> None:
    cache, events = new_cache()
    held = list(range(50, 59))
    insert(cache, held)
    insert(cache, list(range(60, 69)))
    take(events)
    _, node = cache.match_prefix(held)
    cache.inc_lock(node)
    cache.drop_unlocked()
    cleared, stored = take(events)
    assert isinstance(cleared, AllBlocksCleared)
    assert isinstance(stored, BlockStored) and stored.block_hashes == vllm_hashes(held[:8])
    cache.dec_lock(node)


def index_from(batches: list[KVEventBatch], index: set[int]) -> None:
    for batch in batches:
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert not index.intersection(event.block_hashes), "a block stored twice"
                index.update(int(h) for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert index.issuperset(event.block_hashes), "a block removed unannounced"
                index.difference_update(event.block_hashes)
            else:
                index.clear()


def tree_blocks(cache: RadixCache) -> set[int]:
    """Every full block of every cached prefix, from a walk of the tree."""
    out: set[int] = set()
    stack: list[tuple[RadixNode, list[int]]] = [(r, []) for r in cache.roots()]
    while stack:
        node, above = stack.pop()
        path = above + node.key.tolist()
        root = node
        while not isinstance(root, RadixRoot):
            assert root.parent is not None
            root = root.parent
        out.update(vllm_hashes(path, root.namespace.salt))
        stack.extend((child, path) for child in node.children.values())
    return out


def test_an_index_built_from_the_events_always_equals_the_tree() -> None:
    rng = random.Random(7)
    cache, events = new_cache(capacity=96)
    index: set[int] = set()
    bases = [[rng.randrange(1000) for _ in range(20)] for _ in range(4)]
    salts = [CacheNamespace(), CacheNamespace("s1")]
    for _ in range(400):
        tokens = rng.choice(bases)[: rng.randrange(0, 21)] + [
            rng.randrange(1000) for _ in range(rng.randrange(1, 9))
        ]
        ns = rng.choice(salts)
        held, node = cache.match_prefix(tokens, ns)
        cache.inc_lock(node)
        need = len(tokens) - len(held)
        if cache.kv.num_free < need:
            cache.evict(need - cache.kv.num_free)
        new = cache.kv.alloc(need)
        cache.dec_lock(node)
        if new is not None:
            cache.insert(tokens, torch.cat((held, new)), ns)
        if rng.random() < 0.02:
            cache.drop_unlocked()
        batch = events.take()
        index_from([] if batch is None else [batch], index)
        assert index == tree_blocks(cache)


def tier_blocks(cache: RadixCache) -> dict[str, set[int]]:
    """Each tier's full blocks, from a walk of the tree: a block is where its last token is."""
    out: dict[str, set[int]] = {"GPU": set(), "CPU": set(), "STORAGE": set()}
    stack: list[tuple[RadixNode, list[int]]] = [(r, []) for r in cache.roots()]
    while stack:
        node, above = stack.pop()
        path = above + node.key.tolist()
        if not isinstance(node, RadixRoot):
            medium = (
                "GPU"
                if node.value is not None
                else "CPU"
                if node.host_value is not None
                else "STORAGE"
            )
            out[medium].update(vllm_hashes(path)[len(above) // BLOCK :])
        stack.extend((child, path) for child in node.children.values())
    return out


def test_hicache_tiers_announce_each_move_with_its_medium(tmp_path: Path) -> None:
    """Prefixes move device -> host -> storage and back: per medium, the events' index
    equals the tree's tiers after every request."""
    s = build_scheduler(
        ServerConfig(
            max_total_tokens=256,
            chunked_prefill_size=64,
            torch_threads=1,
            hicache_host_tokens=128,
            hicache_storage_dir=str(tmp_path),
        )
    )
    events = BlockEvents(BlockHasher(BLOCK, None))
    s.cache.events = events
    index: dict[str, set[int]] = {"GPU": set(), "CPU": set(), "STORAGE": set()}
    prompts = [[(13 * i + 5 + 97 * j) % 4000 + 50 for i in range(100)] for j in range(4)]
    for req_id, ids in enumerate(prompts + [prompts[0] + [7, 8], prompts[1] + [9]], 1):
        submit(s, req_id, ids, max_new=4)
        run_to_end(s)
        batch = events.take()
        for event in [] if batch is None else batch.events:
            if isinstance(event, BlockStored):
                assert event.medium is not None
                index[event.medium].update(int(h) for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert event.medium is not None
                assert index[event.medium].issuperset(event.block_hashes)
                index[event.medium].difference_update(event.block_hashes)
        assert index == tier_blocks(s.cache)
    assert index["STORAGE"] and index["CPU"]  # both lower tiers were used


@pytest.mark.parametrize(
    "text",
    ['{"enable_kv_cache_events": true, "endpont": "tcp://*:5557"}', '{"buffer_steps": 0}', "{"],
)
def test_a_bad_kv_events_config_fails_the_start_naming_the_flag(text: str) -> None:
    with pytest.raises(ValueError, match="--kv-events-config"):
        check_config(ServerConfig(kv_events_config=text))
