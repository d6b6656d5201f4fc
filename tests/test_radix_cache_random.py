"""Randomized tests of RadixCache against plain reference models.

1. Tree operations (insert / match / lock / unlock / evict) against a dict of cached page-aligned
   prefixes, each with its KV slots, last access tick and lock count. Eviction in the reference
   removes, a page at a time, the least recently used unlocked prefix that no other prefix extends
   (deepest first on ties); the tree removes whole nodes, which is the same order, so after
   `tree.evict` removed E tokens the reference removes E tokens and both must hold the same.
   The same holds under each `--radix-eviction-policy` (lfu, slru, priority): the reference keeps
   each prefix's hit count and priority and evicts by the policy's key, which never decreases
   from a prefix to its extensions, so the tree's whole-node order is still the same.
2. Request lifecycles (chunked prefill, decode, finish, retract) through cache_unfinished_req /
   cache_finished_req, checking that every running request's row points at allocated slots that
   hold its own tokens, and that the pool adds up.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from radixengine.mem_cache.accounting import check_token_accounting
from radixengine.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixengine.mem_cache.chunk_cache import ChunkCache
from radixengine.mem_cache.memory_pool import ReqToTokenPool
from radixengine.mem_cache.radix_cache import RadixCache

NUM_OPS = 20_000


def make_allocator(size: int, page_size: int):
    if page_size == 1:
        return TokenToKVPoolAllocator(size, torch.float16, "cpu", None)
    return PagedTokenToKVPoolAllocator(size, page_size, torch.float16, "cpu", None)


class KeyGen:
    """Keys built from a few page patterns, two of which differ from another only inside the
    page, so matches end mid-edge and mid-page; plus an unaligned random tail."""

    def __init__(self, rng: random.Random, page_size: int, max_pages: int):
        self.rng, self.ps, self.max_pages = rng, page_size, max_pages
        if page_size == 1:
            self.pages = [(0,), (1,), (2,)]
        else:
            a = tuple(rng.randrange(1000) for _ in range(page_size))
            c = tuple(rng.randrange(1000) for _ in range(page_size))
            half = page_size // 2
            b = a[:half] + tuple(rng.randrange(1000, 2000) for _ in range(page_size - half))
            d = c[:-1] + (5000,)
            self.pages = [a, b, c, d]

    def __call__(self) -> list[int]:
        key: list[int] = []
        for _ in range(self.rng.randint(0, self.max_pages)):
            key += self.rng.choice(self.pages)
        key += [self.rng.randrange(9000, 9100) for _ in range(self.rng.randint(0, self.ps - 1))]
        return key


@dataclass
class RefEntry:
    slots: tuple[int, ...]  # the KV slots of the prefix's last page
    tick: int
    hits: int = 0  # inserts through the prefix, a request's own re-inserts aside
    priority: int = 0  # the highest priority that inserted it


EVICTION_KEYS = {
    "lru": lambda e: (e.tick,),
    "lfu": lambda e: (e.hits, e.tick),
    "slru": lambda e: (int(e.hits >= 2), e.tick),
    "priority": lambda e: (e.priority, e.tick),
}


class ReferenceCache:
    """The cache as a dict: page-aligned prefix -> its last page's slots, last access tick, hit
    count and priority."""

    def __init__(self, page_size: int, policy: str = "lru"):
        self.ps = page_size
        self.evict_key = EVICTION_KEYS[policy]
        self.entries: dict[tuple[int, ...], RefEntry] = {}
        self.children: Counter[tuple[int, ...]] = Counter()
        self.locks: Counter[tuple[int, ...]] = Counter()
        self.tick = 0

    def prefixes(self, key: list[int] | tuple[int, ...]) -> list[tuple[int, ...]]:
        key = tuple(key)
        return [key[:end] for end in range(self.ps, len(key) // self.ps * self.ps + 1, self.ps)]

    def match(self, key: list[int], touch: bool = True) -> tuple[int, list[int]]:
        slots: list[int] = []
        matched = []
        for prefix in self.prefixes(key):
            entry = self.entries.get(prefix)
            if entry is None:
                break
            matched.append(entry)
            slots += entry.slots
        if touch and self.prefixes(key):
            self.tick += 1
            for entry in matched:
                entry.tick = self.tick
        return len(slots), slots

    def insert(self, key: list[int], value: list[int], priority: int = 0, counted_len: int = 0) -> int:
        present, _ = self.match(key, touch=False)
        self.tick += 1
        for prefix in self.prefixes(key):
            entry = self.entries.get(prefix)
            if entry is None:
                slots = tuple(value[len(prefix) - self.ps : len(prefix)])
                entry = self.entries[prefix] = RefEntry(slots, 0, priority=priority)
                if len(prefix) > self.ps:
                    self.children[prefix[: -self.ps]] += 1
            entry.tick = self.tick
            entry.hits += len(prefix) > counted_len
            entry.priority = max(entry.priority, priority)
        return present

    def lock(self, matched_key: tuple[int, ...], delta: int) -> None:
        for prefix in self.prefixes(matched_key):
            self.locks[prefix] += delta
            if self.locks[prefix] == 0:
                del self.locks[prefix]

    def evictable(self) -> int:
        return (len(self.entries) - len(self.locks)) * self.ps

    def evict_tokens(self, num_tokens: int) -> list[int]:
        freed: list[int] = []
        for _ in range(num_tokens // self.ps):
            leaves = [p for p in self.entries if not self.children[p] and p not in self.locks]
            victim = min(leaves, key=lambda p: (*self.evict_key(self.entries[p]), -len(p)))
            freed += self.entries.pop(victim).slots
            if len(victim) > self.ps:
                self.children[victim[: -self.ps]] -= 1
        return freed


def tree_contents(tree: RadixCache) -> dict[tuple[int, ...], tuple[int, ...]]:
    """page-aligned prefix -> slots of its last page, read from the tree."""
    ps, out = tree.page_size, {}
    stack = [(child, ()) for child in tree.root_node.children.values()]
    while stack:
        node, above = stack.pop()
        assert len(node.key) % ps == 0 and len(node.key) == len(node.value) > 0
        values = node.value.tolist()
        for end in range(ps, len(node.key) + 1, ps):
            out[above + node.key[:end]] = tuple(values[end - ps : end])
        stack.extend((child, above + node.key) for child in node.children.values())
    return out


class TreeOpsSim:
    MAX_LOCKS = 6

    def __init__(self, page_size: int, seed: int, policy: str = "lru", evict_leaf_tails: bool = False):
        self.rng = random.Random(seed)
        self.ps = page_size
        self.alloc = make_allocator(40 * page_size, page_size)
        self.tree = RadixCache(
            None, self.alloc, page_size, eviction_policy=policy, evict_leaf_tails=evict_leaf_tails
        )
        self.ref = ReferenceCache(page_size, policy)
        self.keys = KeyGen(self.rng, page_size, max_pages=10 if page_size == 1 else 5)
        self.held: list[tuple[tuple[int, ...], Any]] = []

    def run(self, num_ops: int) -> Counter[str]:
        ops = [self.match, self.insert, self.insert_duplicate, self.lock, self.unlock, self.evict]
        weights = [30, 20, 10, 12, 13, 15]
        done: Counter[str] = Counter()
        for step in range(num_ops):
            op = self.rng.choices(ops, weights)[0]
            op()
            done[op.__name__] += 1
            self.check_sizes()
            if op is self.evict or step % 50 == 0:
                self.check_contents()
        while self.held:
            self.unlock()
        self.check_contents()
        assert self.tree.protected_size() == 0
        return done

    def match(self) -> tuple[list[int], Any]:
        key = self.keys()
        result = self.tree.match_prefix(key)
        length, slots = self.ref.match(key)
        assert result.device_indices.tolist() == slots
        assert result.device_indices.dtype == torch.int64
        return key[:length], result.last_node

    def lock(self) -> None:
        if len(self.held) >= self.MAX_LOCKS:
            return self.unlock()
        matched, node = self.match()
        self.tree.inc_lock_ref(node)
        self.ref.lock(tuple(matched), +1)
        self.held.append((tuple(matched), node))

    def unlock(self) -> None:
        if self.held:
            matched, node = self.held.pop(self.rng.randrange(len(self.held)))
            self.tree.dec_lock_ref(node)
            self.ref.lock(matched, -1)

    def evict(self, num_tokens: int | None = None) -> None:
        if num_tokens is None:
            num_tokens = self.rng.randint(1, 3 * self.ps)
        evictable = self.tree.evictable_size()
        assert evictable == self.ref.evictable()
        available = self.alloc.available_size()
        evicted = self.tree.evict(num_tokens)
        assert min(num_tokens, evictable) <= evicted <= evictable
        assert self.alloc.available_size() == available + evicted
        self.ref.evict_tokens(evicted)

    def _make_room(self, need: int) -> bool:
        if need > self.alloc.available_size():
            self.evict(need - self.alloc.available_size())
        return need <= self.alloc.available_size()

    def insert(self) -> None:
        """Like a finished request: reuse the matched prefix, allocate the rest."""
        key = self.keys()
        aligned = len(key) // self.ps * self.ps
        self.match()  # another key first, so the LRU order moves
        key_match = self.tree.match_prefix(key)
        length, _ = self.ref.match(key)
        assert len(key_match.device_indices) == length
        self.tree.inc_lock_ref(key_match.last_node)
        self.ref.lock(tuple(key[:length]), +1)
        if self._make_room(aligned - length):
            new = self.alloc.alloc(aligned - length)
            value = torch.cat((key_match.device_indices, new))
            padded = torch.cat((value, torch.zeros(len(key) - aligned, dtype=torch.int64)))
            priority = self.rng.choice([-3, 0, 0, 2, 7])
            # As the same request inserting again: what it inserted before ends at a node boundary.
            counted_len = self.rng.choice([0, 0, 0, length, aligned])
            present = self.tree.insert(key, padded, priority, counted_len)
            assert present == self.ref.insert(key, value.tolist(), priority, counted_len) == length
        self.tree.dec_lock_ref(key_match.last_node)
        self.ref.lock(tuple(key[:length]), -1)

    def insert_duplicate(self) -> None:
        """Like a request that computed a prefix another one cached meanwhile: all slots fresh."""
        key = self.keys()
        aligned = len(key) // self.ps * self.ps
        if not self._make_room(aligned):
            return
        value = self.alloc.alloc(aligned)
        priority = self.rng.choice([-3, 0, 0, 2, 7])
        present = self.tree.insert(key[:aligned], value, priority)
        assert present == self.ref.insert(key[:aligned], value.tolist(), priority)
        self.alloc.free(value[:present])

    def check_sizes(self) -> None:
        tree, ref = self.tree, self.ref
        check_token_accounting(self.alloc, tree, None)
        assert tree.protected_size() == len(ref.locks) * self.ps
        assert tree.evictable_size() + tree.protected_size() == len(ref.entries) * self.ps

    def check_contents(self) -> None:
        contents = tree_contents(self.tree)
        assert contents == {prefix: entry.slots for prefix, entry in self.ref.entries.items()}
        assert self.tree.total_size() == len(contents) * self.ps
        cached = torch.tensor([s for slots in contents.values() for s in slots], dtype=torch.int64)
        pages = cached // self.ps
        assert not self.alloc.free_mask[pages].any(), "a cached slot is free in the allocator"
        assert len(torch.unique(pages)) * self.ps == len(cached), "two cached pages share a slot"


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_tree_ops_match_the_reference(page_size):
    done = TreeOpsSim(page_size, seed=1234 + page_size).run(NUM_OPS)
    assert sum(done.values()) == NUM_OPS
    assert min(done.values()) > NUM_OPS // 20


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", ["lfu", "slru", "priority"])
def test_tree_ops_match_the_reference_under_each_eviction_policy(policy, page_size):
    sim = TreeOpsSim(page_size, seed=4321 + page_size, policy=policy)
    done = sim.run(NUM_OPS // 2)
    assert done["evict"] > NUM_OPS // 40


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("policy", ["lru", "priority"])
def test_tree_ops_match_the_reference_when_evicting_leaf_tails(policy, page_size):
    """With `evict_leaf_tails` the tree frees the pages asked for (rounded up to a page), the
    last pages of the leaf with the smallest key: the reference's page-by-page eviction."""
    sim = TreeOpsSim(page_size, seed=987 + page_size, policy=policy, evict_leaf_tails=True)
    done = sim.run(NUM_OPS // 2)
    assert done["evict"] > NUM_OPS // 40


# ---- request lifecycles ----


@dataclass
class SimReq:
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    req_pool_idx: int = -1
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    hit_counted_len: int = 0
    kv_len: int = 0  # tokens with KV written in the row
    priority: int | None = None

    @property
    def prefilling(self) -> bool:
        return self.kv_len < len(self.origin_input_ids)


class LifecycleSim:
    MAX_RUNNING = 6

    def __init__(self, kind: str, page_size: int, seed: int, policy: str = "lru"):
        self.rng = random.Random(seed)
        self.ps = page_size
        size = 32 * page_size
        self.alloc = make_allocator(size, page_size)
        self.pool = ReqToTokenPool(8, 8 * page_size + 64, "cpu")
        if kind == "chunk":
            self.tree = ChunkCache(self.pool, self.alloc, page_size)
        else:
            self.tree = RadixCache(self.pool, self.alloc, page_size, eviction_policy=policy)
        self.shared = kind == "radix"
        self.keys = KeyGen(self.rng, page_size, max_pages=12 if page_size == 1 else 4)
        self.running: list[SimReq] = []
        self.content_tok = np.full(size + page_size, -1, dtype=np.int64)
        self.content_pos = np.full(size + page_size, -1, dtype=np.int64)
        self.stats: Counter[str] = Counter()

    def run(self, steps: int) -> Counter[str]:
        for _ in range(steps):
            action = self.rng.choices([self.admit, self.prefill_chunk, self.decode], [2, 4, 6])[0]
            action()
            self.check_running()
        for req in [r for r in self.running if not r.prefilling]:
            self.finish(req, is_insert=True)
        for _ in range(1000):
            if not self.running:
                break
            self.prefill_chunk()
            self.check_running()
            for req in [r for r in self.running if not r.prefilling]:
                self.finish(req, is_insert=True)
        assert not self.running
        check_token_accounting(self.alloc, self.tree, self.pool)
        self.tree.evict(self.alloc.size)
        assert self.alloc.available_size() == self.alloc.size
        return self.stats

    def tokens(self, req: SimReq) -> list[int]:
        return req.origin_input_ids + req.output_ids

    def admit(self) -> None:
        ids = self.keys()
        if not ids or len(self.running) >= self.MAX_RUNNING:
            return
        prefilling = [r for r in self.running if r.prefilling] + [SimReq(origin_input_ids=ids)]
        budget = sum(len(r.origin_input_ids) - r.kv_len + self.ps for r in prefilling)
        if budget > self.alloc.available_size() + self.tree.evictable_size():
            return  # admission control: running prefills can always finish
        req = SimReq(origin_input_ids=ids, priority=self.rng.choice([None, 0, 3, -2]))
        match = self.tree.match_prefix(ids[:-1])  # the last prompt token is always computed
        req.prefix_indices, req.last_node = match.device_indices, match.last_node
        self.tree.inc_lock_ref(req.last_node)
        req.req_pool_idx = self.pool.alloc(1)[0]
        req.kv_len = len(req.prefix_indices)
        self.pool.write((req.req_pool_idx, slice(0, req.kv_len)), req.prefix_indices)
        self.running.append(req)
        self.stats["admit"] += 1
        self.stats["prefix_hit_tokens"] += req.kv_len

    def _alloc(self, req: SimReq, new_len: int) -> torch.Tensor | None:
        """Slots for tokens kv_len..new_len of `req`, evicting and then retracting others."""
        need_pages = -(-new_len // self.ps) - -(-req.kv_len // self.ps)
        while True:
            if self.alloc.available_size() < need_pages * self.ps:
                self.tree.evict(need_pages * self.ps - self.alloc.available_size())
            row = self.pool.req_to_token[req.req_pool_idx]
            last = int(row[req.kv_len - 1]) if req.kv_len else -1
            if self.ps == 1:
                slots = self.alloc.alloc(new_len - req.kv_len)
            else:
                slots = self.alloc.alloc_extend([req.kv_len], [new_len], [last], new_len - req.kv_len)
            if slots is not None:
                return slots
            victims = [r for r in self.running if r is not req and not r.prefilling]
            if not victims:
                return None
            self.finish(self.rng.choice(victims), is_insert=False)
            self.stats["retract"] += 1

    def _write(self, req: SimReq, new_len: int, slots: torch.Tensor) -> None:
        self.pool.write((req.req_pool_idx, slice(req.kv_len, new_len)), slots)
        idx = slots.numpy()
        self.content_tok[idx] = self.tokens(req)[req.kv_len : new_len]
        self.content_pos[idx] = np.arange(req.kv_len, new_len)
        req.kv_len = new_len

    def prefill_chunk(self) -> None:
        prefilling = [r for r in self.running if r.prefilling]
        if not prefilling:
            return
        req = self.rng.choice(prefilling)
        end = min(len(req.origin_input_ids), req.kv_len + self.rng.randint(1, 2 * self.ps + 1))
        slots = self._alloc(req, end)
        if slots is None:
            return
        self._write(req, end, slots)
        req.fill_ids = req.origin_input_ids[:end]
        if not req.prefilling:
            req.output_ids.append(self.rng.randrange(3))
        self.tree.cache_unfinished_req(req)
        self.stats["chunk"] += 1

    def decode(self) -> None:
        decoding = [r for r in self.running if not r.prefilling]
        if not decoding:
            return
        req = self.rng.choice(decoding)
        if self.rng.random() < 0.15 or len(req.output_ids) >= 32:
            self.finish(req, is_insert=True)
            return
        slots = self._alloc(req, req.kv_len + 1)
        if slots is None or req not in self.running:
            return
        self._write(req, req.kv_len + 1, slots)
        req.output_ids.append(self.rng.randrange(3))
        self.stats["decode"] += 1

    def finish(self, req: SimReq, is_insert: bool) -> None:
        assert req.kv_len == len(self.tokens(req)) - 1
        self.tree.cache_finished_req(req, is_insert=is_insert)
        self.running.remove(req)
        self.stats["finish"] += 1

    def private_tokens(self, req: SimReq) -> int:
        held = -(-req.kv_len // self.ps) * self.ps
        owned = len(req.prefix_indices)
        return held - (owned // self.ps * self.ps if self.shared else owned)

    def check_running(self) -> None:
        private = sum(self.private_tokens(r) for r in self.running)
        tree = self.tree
        assert (
            self.alloc.available_size() + tree.evictable_size() + tree.protected_size() + private
            == self.alloc.size
        )
        for req in self.running:
            row = self.pool.req_to_token[req.req_pool_idx, : req.kv_len].numpy().astype(np.int64)
            assert not self.alloc.free_mask[torch.from_numpy(row // self.ps)].any(), (
                "row points at a free slot"
            )
            assert (self.content_tok[row] == self.tokens(req)[: req.kv_len]).all(), (
                "row points at other tokens"
            )
            assert (self.content_pos[row] == np.arange(req.kv_len)).all()


@pytest.mark.parametrize(
    "kind,page_size", [("radix", 1), ("radix", 4), ("radix", 16), ("chunk", 4), ("chunk", 1)]
)
def test_request_lifecycles_keep_rows_and_accounting(kind, page_size):
    stats = LifecycleSim(kind, page_size, seed=99 + page_size).run(2000)
    assert stats["finish"] > 50 and stats["chunk"] > 100 and stats["decode"] > 300
    if kind == "radix":
        assert stats["prefix_hit_tokens"] > 0


@pytest.mark.parametrize("policy", ["lfu", "slru", "priority"])
def test_request_lifecycles_under_each_eviction_policy(policy):
    stats = LifecycleSim("radix", 4, seed=7, policy=policy).run(2000)
    assert stats["finish"] > 50 and stats["chunk"] > 100 and stats["prefix_hit_tokens"] > 0
