"""The radix prefix cache against a real (debug) KV pool: matches return the right slots,
inserts free exactly the duplicate slots, eviction is LRU and respects locks, and the pool
accounting always adds up."""

from __future__ import annotations

import random

import pytest
import torch

from scheduler_proc.cache.kv_pool import KVPool
from scheduler_proc.cache.radix_cache import RadixCache
from scheduler_proc.cache.radix_node import RadixNode


def new_pool(capacity: int = 64) -> KVPool:
    # debug=True: the pool itself asserts on double frees and frees of unallocated slots.
    return KVPool(1, capacity, 1, 2, torch.float32, "cpu", debug=True)


def alloc(kv: KVPool, n: int) -> torch.Tensor:
    slots = kv.alloc(n)
    assert slots is not None
    return slots


def cached(cache: RadixCache, ids: list[int]) -> list[int]:
    return cache.match_prefix(ids)[0].tolist()


def tree_map(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """Every cached prefix -> the slot of its last token, from a walk of the tree, checking
    the tree's structural invariants on the way."""
    out: dict[tuple[int, ...], int] = {}
    evictable = protected = 0
    stack: list[tuple[RadixNode, tuple[int, ...]]] = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for first, child in node.children.items():
            assert child.parent is node
            assert len(child.key) == child.value.numel() > 0
            assert int(child.key[0]) == first
            assert child.lock_ref >= 0
            if node is not cache.root:
                assert node.lock_ref >= child.lock_ref  # locks count on every ancestor
            if child.lock_ref:
                protected += len(child.key)
            else:
                evictable += len(child.key)
            p = prefix
            for tok, slot in zip(child.key.tolist(), child.value.tolist()):
                p = p + (tok,)
                out[p] = slot
            stack.append((child, p))
    assert (cache.evictable_size, cache.protected_size) == (evictable, protected)
    assert cache.total_size == evictable + protected == len(out)
    assert len(set(out.values())) == len(out), "a slot is held by two tree positions"
    return out


def test_match_on_empty_tree() -> None:
    cache = RadixCache(new_pool())
    slots, node = cache.match_prefix([1, 2, 3])
    assert slots.dtype == torch.long and slots.numel() == 0
    assert node is cache.root
    slots, node = cache.match_prefix([])
    assert slots.numel() == 0 and node is cache.root
    assert cache.total_size == cache.evictable_size == cache.protected_size == 0


def test_insert_then_exact_partial_and_longer_matches() -> None:
    kv = new_pool()
    cache = RadixCache(kv)
    slots = alloc(kv, 5)
    assert cache.insert([1, 2, 3, 4, 5], slots) == 0
    assert kv.num_used == cache.total_size == cache.evictable_size == 5
    want = slots.tolist()

    assert cached(cache, [1, 2, 3, 4, 5]) == want
    assert cached(cache, [1, 2, 3, 4, 5, 6, 7]) == want  # longer: the whole cached run
    assert cached(cache, [1, 2, 3, 9]) == want[:3]  # diverges inside the node
    assert cached(cache, [1, 2]) == want[:2]  # ends inside the node
    assert cached(cache, [2, 3]) == []  # no common first token
    _, node = cache.match_prefix([1, 2, 3, 4, 5])
    assert node.value.tolist() == want[3:]  # earlier matches split the run at 3, then 2
    assert node.parent is not None and node.parent.value.tolist() == [want[2]]
    tree_map(cache)


def test_partial_match_splits_node_and_both_halves_keep_slots() -> None:
    kv = new_pool()
    cache = RadixCache(kv)
    slots = alloc(kv, 6)
    cache.insert([10, 11, 12, 13, 14, 15], slots)
    (leaf,) = cache.root.children.values()

    got, head = cache.match_prefix([10, 11, 12, 99])
    assert got.tolist() == slots[:3].tolist()
    assert head.key.tolist() == [10, 11, 12] and head.value.tolist() == slots[:3].tolist()
    assert head.parent is cache.root and cache.root.children[10] is head
    # The original node object keeps the tail, so references to it stay valid.
    assert head.children[13] is leaf and leaf.parent is head
    assert leaf.key.tolist() == [13, 14, 15] and leaf.value.tolist() == slots[3:].tolist()
    assert cached(cache, [10, 11, 12, 13, 14, 15]) == slots.tolist()
    assert cache.total_size == 6 and kv.num_used == 6  # a split moves no slots
    tree_map(cache)


def test_overlapping_insert_frees_exactly_the_duplicates() -> None:
    kv = new_pool()
    cache = RadixCache(kv)
    a = alloc(kv, 4)
    assert cache.insert([1, 2, 3, 4], a) == 0

    # A request that computed [1, 2, 3, 7, 8] itself: its first 3 slots duplicate the tree's.
    b = alloc(kv, 5)
    used = kv.num_used
    assert cache.insert([1, 2, 3, 7, 8], b) == 3
    assert kv.num_used == used - 3  # exactly the duplicates went back
    assert kv.num_used == cache.total_size == 6
    assert cached(cache, [1, 2, 3, 7, 8]) == a[:3].tolist() + b[3:].tolist()
    assert cached(cache, [1, 2, 3, 4]) == a.tolist()

    # A request that matched [1, 2, 3, 7] from the cache holds the tree's own slots for it:
    # inserting its sequence must free only its slots that differ from the tree's.
    prefix, node = cache.match_prefix([1, 2, 3, 7, 9])
    cache.inc_lock(node)
    extra = alloc(kv, 2)
    mine = torch.cat((prefix, extra))
    used = kv.num_used
    assert cache.insert([1, 2, 3, 7, 9, 9], mine) == 4
    cache.dec_lock(node)
    assert kv.num_used == used  # nothing freed: the tree owns the prefix, took the rest
    assert kv.num_used == cache.total_size == 8
    assert cached(cache, [1, 2, 3, 7, 9, 9]) == mine.tolist()

    # Mixed: part of the prefix is the tree's own slot, part a private duplicate.
    own = cache.match_prefix([1, 2])[0]
    dup = alloc(kv, 2)
    used = kv.num_used
    assert cache.insert([1, 2, 3, 4], torch.cat((own, dup))) == 4
    assert kv.num_used == used - 2
    assert kv.num_used == cache.total_size == 8
    tree_map(cache)


def test_insert_rejects_length_mismatch() -> None:
    kv = new_pool()
    cache = RadixCache(kv)
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], alloc(kv, 2))


def test_eviction_is_lru_and_cascades_to_parents() -> None:
    kv = new_pool()
    cache = RadixCache(kv)
    cache.insert([1, 2, 3], alloc(kv, 3))
    cache.insert([1, 2, 3, 4, 5], torch.cat((cache.match_prefix([1, 2, 3])[0], alloc(kv, 2))))
    cache.insert([1, 2, 3, 6, 7], torch.cat((cache.match_prefix([1, 2, 3])[0], alloc(kv, 2))))
    cache.insert([8, 9], alloc(kv, 2))
    assert kv.num_used == cache.total_size == 9

    cache.match_prefix([1, 2, 3, 4, 5])  # [1,2,3]+[4,5] most recent; [8,9] then [6,7] older
    cache.match_prefix([8, 9])
    cache.match_prefix([1, 2, 3, 4, 5])
    assert cache.evict(1) == 2  # the LRU leaf [6, 7], whole
    assert cached(cache, [1, 2, 3, 6, 7]) == cached(cache, [1, 2, 3])
    assert cache.evict(2) == 2  # then [8, 9]
    assert cached(cache, [8, 9]) == []
    # [4, 5] goes, then its parent [1, 2, 3] is a leaf and goes too.
    assert cache.evict(5) == 5
    assert cache.total_size == 0 and kv.num_used == 0
    assert cache.evict(1) == 0  # nothing left
    tree_map(cache)


def test_locked_path_survives_eviction_until_unlocked() -> None:
    kv = new_pool()
    cache = RadixCache(kv)
    a = alloc(kv, 4)
    cache.insert([1, 2, 3, 4], a)
    cache.insert([1, 2, 5, 6], torch.cat((a[:2], alloc(kv, 2))))
    cache.insert([7, 7, 7], alloc(kv, 3))

    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock(node)
    cache.inc_lock(node)  # ref counted: two holders
    assert cache.protected_size == 4 and cache.evictable_size == 5

    assert cache.evict(100) == 5  # everything not on the locked path
    assert cached(cache, [1, 2, 3, 4]) == a.tolist()
    assert kv.num_used == cache.total_size == cache.protected_size == 4
    cache.reset()
    assert cached(cache, [1, 2, 3, 4]) == a.tolist()

    cache.dec_lock(node)
    assert cache.evict(100) == 0  # still one holder
    cache.dec_lock(node)
    assert cache.protected_size == 0 and cache.evictable_size == 4
    with pytest.raises(RuntimeError):
        cache.dec_lock(node)
    assert cache.evict(1) == 2  # whole nodes: the leaf [3, 4]
    assert cache.evict(1) == 2  # then [1, 2], a leaf now
    assert cache.total_size == 0 and kv.num_used == 0
    with pytest.raises(RuntimeError):
        cache.inc_lock(node)  # evicted: a stale reference must not corrupt the counts


def test_lock_survives_a_later_split_of_its_node() -> None:
    kv = new_pool()
    cache = RadixCache(kv)
    slots = alloc(kv, 6)
    cache.insert([1, 2, 3, 4, 5, 6], slots)
    _, node = cache.match_prefix([1, 2, 3, 4, 5, 6])
    cache.inc_lock(node)
    cache.match_prefix([1, 2, 9])  # splits the locked node; the head inherits the lock
    assert cache.protected_size == 6 and cache.evict(100) == 0
    cache.dec_lock(node)
    assert cache.protected_size == 0 and cache.evictable_size == 6
    assert cache.evict(100) == 6 and kv.num_used == 0


def test_reset_frees_everything_unlocked() -> None:
    kv = new_pool()
    cache = RadixCache(kv)
    for i in range(4):
        cache.insert([i, i + 1, i + 2], alloc(kv, 3))
    cache.reset()
    assert cache.total_size == 0 and kv.num_used == 0 and not cache.root.children


def test_randomized_requests_keep_pool_accounting() -> None:
    """Simulated requests alloc, match, lock, extend and insert on finish while the cache
    evicts under pressure. At every step: pool used == tree + requests' own slots, the tree
    agrees with a reference map of prefix -> slot, and locked prefixes never move."""
    rng = random.Random(1234)
    kv = new_pool(64)
    cache = RadixCache(kv)
    bases = [[rng.randrange(8) for _ in range(12)] for _ in range(4)]
    ref: dict[tuple[int, ...], int] = {}

    class FakeReq:
        def __init__(
            self, ids: list[int], prefix: torch.Tensor, node: RadixNode, own: torch.Tensor
        ) -> None:
            self.ids = ids
            self.prefix = prefix  # the tree's slots, borrowed under the lock
            self.node = node
            self.own = own  # slots this request allocated and still holds

        @property
        def slots(self) -> torch.Tensor:
            return torch.cat((self.prefix, self.own))

    running: list[FakeReq] = []

    def alloc_or_evict(n: int) -> torch.Tensor | None:
        slots = kv.alloc(n)
        if slots is None:
            cache.evict(n - kv.num_free)
            slots = kv.alloc(n)
        return slots

    def check_match(ids: list[int], got: list[int]) -> None:
        for i, slot in enumerate(got):
            assert ref[tuple(ids[: i + 1])] == slot
        assert tuple(ids[: len(got) + 1]) not in ref or len(got) == len(ids)

    def check() -> None:
        held = sum(r.own.numel() for r in running)
        assert kv.num_used == cache.total_size + held
        tm = tree_map(cache)
        assert tm.items() <= ref.items()  # eviction only removes
        ref.clear()
        ref.update(tm)
        in_tree = set(tm.values())
        for r in running:
            assert not (set(r.own.tolist()) & in_tree)
            # A locked prefix stays cached at the same slots.
            assert r.prefix.tolist() == [tm[tuple(r.ids[: i + 1])] for i in range(r.prefix.numel())]

    ops = ["start", "start", "extend", "finish", "finish", "match", "evict"]
    for _ in range(200):
        op = rng.choice(ops)
        if op == "start" and len(running) < 6:
            base = rng.choice(bases)
            ids = base[: rng.randrange(1, len(base) + 1)] + [
                rng.randrange(8) for _ in range(rng.randrange(0, 6))
            ]
            prefix, node = cache.match_prefix(ids)
            check_match(ids, prefix.tolist())
            cache.inc_lock(node)  # lock before allocating: the eviction below must spare it
            own = alloc_or_evict(len(ids) - prefix.numel())
            if own is None:
                cache.dec_lock(node)
            else:
                running.append(FakeReq(ids, prefix, node, own))
        elif op == "extend" and running:
            r = rng.choice(running)
            n = rng.randrange(1, 4)
            more = alloc_or_evict(n)
            if more is not None:
                r.ids = r.ids + [rng.randrange(8) for _ in range(n)]
                r.own = torch.cat((r.own, more))
        elif op == "finish" and running:
            r = running.pop(rng.randrange(len(running)))
            before = cache.match_prefix(r.ids)[0].tolist()
            check_match(r.ids, before)
            assert before[: r.prefix.numel()] == r.prefix.tolist()
            used = kv.num_used
            already = cache.insert(r.ids, r.slots)
            assert already == len(before)
            # Exactly the duplicates that are not the tree's own slots were freed.
            mine = r.slots.tolist()
            dups = sum(1 for i in range(already) if mine[i] != before[i])
            assert kv.num_used == used - dups
            for i in range(already, len(r.ids)):
                ref[tuple(r.ids[: i + 1])] = mine[i]
            cache.dec_lock(r.node)
            assert tree_map(cache) == ref
        elif op == "match":
            ids = rng.choice(bases)[: rng.randrange(1, 13)]
            check_match(ids, cached(cache, ids))
        elif op == "evict":
            want = rng.randrange(1, 16)
            evictable = cache.evictable_size
            freed = cache.evict(want)
            assert freed >= min(want, evictable) or freed == evictable
            assert cache.evictable_size == evictable - freed
        check()

    for r in running[:]:
        running.remove(r)
        already = cache.insert(r.ids, r.slots)
        mine = r.slots.tolist()
        for i in range(already, len(r.ids)):
            ref[tuple(r.ids[: i + 1])] = mine[i]
        cache.dec_lock(r.node)
        check()
    cache.reset()
    assert cache.total_size == 0 and kv.num_used == 0
