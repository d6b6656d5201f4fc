"""The host tier's tree logic (mem_cache/host_radix_cache.py) on a CPU pool: a node's state
(device / host / both), eviction to the host, load back with the same KV bytes, the host pool's
own eviction, host locks while a load is in flight, and the token accounting of both pools."""

from __future__ import annotations

import threading

import pytest
import torch

from radixengine.mem_cache.accounting import TokenAccountingError, check_token_accounting
from radixengine.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixengine.mem_cache.host_radix_cache import HostRadixCache
from radixengine.mem_cache.memory_pool import MHATokenToKVPool
from radixengine.mem_cache.memory_pool_host import HostKVPool
from radixengine.utils.streams import CpuStream

LAYERS, HEADS, DIM = 2, 2, 4


class Tier:
    def __init__(self, page: int = 1, size: int = 64, host: int = 64, policy: str = "write_back"):
        self.pool = MHATokenToKVPool(size, page, torch.float32, HEADS, DIM, LAYERS, "cpu")
        if page == 1:
            self.alloc = TokenToKVPoolAllocator(size, torch.float32, "cpu", self.pool)
        else:
            self.alloc = PagedTokenToKVPoolAllocator(size, page, torch.float32, "cpu", self.pool)
        self.host = HostKVPool.like(self.pool, host)
        self.tree = HostRadixCache(None, self.alloc, page, host_pool=self.host, write_policy=policy)

    def insert(self, tokens: list[int]) -> int:
        """Insert `tokens` with KV that names them (K = token id, V = -token id, every layer), as
        a request hands its KV over: the slots of what was present are freed. Returns that."""
        slots = self.alloc.alloc(len(tokens))
        kv = torch.tensor(tokens, dtype=torch.float32)[:, None, None].expand(-1, HEADS, DIM)
        for layer in range(LAYERS):
            self.pool.set_kv_buffer(layer, slots, kv + layer, -kv - layer)
        present = self.tree.insert(tokens, slots)
        self.alloc.free(slots[:present])
        return present

    def device_match(self, tokens: list[int]) -> torch.Tensor:
        return self.tree.match_prefix(tokens).device_indices

    def assert_kv_is(self, slots: torch.Tensor, tokens: list[int]) -> None:
        expect = torch.tensor(tokens, dtype=torch.float32)[:, None, None].expand(-1, HEADS, DIM)
        for layer in range(LAYERS):
            assert torch.equal(self.pool.k_buffer[layer][slots], expect + layer)
            assert torch.equal(self.pool.v_buffer[layer][slots], -expect - layer)

    def check(self) -> None:
        check_token_accounting(self.alloc, self.tree)


A = list(range(100, 132))
B = list(range(200, 232))
C = list(range(300, 332))


@pytest.mark.parametrize("page", [1, 16])
def test_evicted_node_goes_to_host_and_comes_back_with_its_kv(page):
    t = Tier(page)
    t.insert(A)
    assert t.tree.evict(len(A)) == len(A)
    t.check()
    (node,) = t.tree.root_node.children.values()
    assert node.value is None and node.host_value is not None  # on the host only
    assert t.device_match(A).numel() == 0 and t.tree.evictable_size() == 0
    assert t.alloc.available_size() == t.alloc.size
    t.pool.k_buffer[0].zero_()  # the device copy is gone for good
    assert t.tree.load_back(A) == len(A)
    t.check()
    slots = t.device_match(A)
    assert slots.numel() == len(A) and node.value is not None and node.host_value is not None  # both
    t.assert_kv_is(slots, A)
    assert t.tree.tier_stats()["host_tokens_loaded"] == len(A)


def test_a_node_on_both_is_evicted_without_a_second_copy():
    t = Tier()
    t.insert(A)
    t.tree.evict(len(A))
    t.tree.load_back(A)
    t.tree.evict(len(A))
    assert t.tree.host_tokens_written == len(A)  # the host copy was still there
    assert t.tree.load_back(A) == len(A)
    t.assert_kv_is(t.device_match(A), A)
    t.check()


def test_load_back_of_a_longer_key_continues_the_device_match():
    t = Tier(page=16)
    t.insert(A)
    assert t.insert(A[:16] + B[:16]) == 16  # A splits after its first page
    t.tree.evict(64)  # both leaves, then their parent (the shared page), to the host
    t.check()
    assert t.device_match(A).numel() == 0
    assert t.tree.load_back(A[:16] + B[:16] + [1, 2]) == 32  # the device has nothing: all from the host
    t.assert_kv_is(t.device_match(A[:16] + B[:16]), A[:16] + B[:16])
    assert t.device_match(A).numel() == 16  # A's own tail is still on the host only
    t.check()


def test_a_full_host_pool_evicts_its_least_recent_nodes():
    t = Tier(host=64)
    for tokens in (A, B):
        t.insert(tokens)
        t.tree.evict(len(tokens))
    assert t.host.available_size() == 0
    t.insert(C)
    t.tree.evict(len(C))  # A, the least recently used on the host, makes room
    t.check()
    assert t.tree.load_back(A) == 0 and t.tree.load_back(B) == len(B) and t.tree.load_back(C) == len(C)
    assert t.tree.tier_stats()["host_tokens_evicted"] == len(A)
    assert A[0] not in t.tree.root_node.children


def test_a_node_without_host_room_is_deleted():
    t = Tier(size=128, host=16)
    t.insert(A)
    assert t.insert(A + B[:16]) == len(A)
    t.tree.evict(16)  # the child (16 tokens) to the host: the pool is full
    assert t.host.available_size() == 0
    t.tree.evict(len(A))  # A needs 32 host slots: the child is evicted from the host, A deleted
    t.check()
    assert not t.tree.root_node.children and t.host.available_size() == 16
    assert t.tree.load_back(A + B[:16]) == 0


def test_recomputing_a_node_on_the_host_gives_it_device_slots_again():
    t = Tier()
    t.insert(A)
    t.tree.evict(len(A))
    slots = t.alloc.alloc(len(A))
    assert t.tree.insert(A, slots) == 0  # nothing present on the device: the tree takes the slots
    assert torch.equal(t.device_match(A), slots)
    assert t.tree.evictable_size() == len(A)
    t.check()


def test_write_through_backs_up_a_finished_path_once():
    t = Tier(policy="write_through")
    t.insert(A)
    t.tree._write_through(tuple(A))
    t.tree._write_through(tuple(A))
    assert t.tree.host_tokens_written == len(A)
    t.tree.evict(len(A))
    assert t.tree.host_tokens_written == len(A)  # eviction found the host copy
    t.check()


def test_a_load_in_flight_locks_its_host_slots():
    """A load queued on the pool's write stream (the overlap loop) reads the host slots later:
    until it ran, host eviction may not hand them to another node."""
    t = Tier(host=32)
    stream, gate = CpuStream("test"), threading.Event()
    t.tree.set_pool_write_stream(stream)
    t.insert(A)
    t.tree.evict(len(A))
    stream.submit(gate.wait)  # the forward in flight
    assert t.tree.load_back(A) == len(A)
    (node,) = t.tree.root_node.children.values()
    assert node.host_lock_ref == 1 and t.tree.tier_stats()["host_loads_in_flight"] == 1
    t.tree.evict(len(A))  # back on the host only, its load still queued
    assert t.tree.evict_host(len(A)) == 0  # locked
    t.insert(B)
    t.tree.evict(len(B))  # no host room, A locked: B is deleted, A survives
    assert t.tree.root_node.children == {A[0]: node}
    gate.set()
    stream.synchronize()
    assert t.tree.evict_host(len(A)) == len(A)  # the load ran: unlocked
    assert node.host_lock_ref == 0
    t.check()
    stream.close()


def test_the_accounting_counts_host_slots():
    t = Tier()
    t.insert(A)
    t.tree.evict(len(A))
    t.check()
    leaked = t.host.alloc(4)  # held by no node
    with pytest.raises(
        TokenAccountingError, match="host slots: available 28 \\+ held by nodes 32 != host pool size 64"
    ):
        t.check()
    t.host.free(leaked)
    t.check()


def _assert_tree_kv(t: Tier) -> None:
    """Every node's device slots hold its tokens' KV, and so do its host slots."""
    for node in t.tree._iter_nodes():
        assert node.value is not None or node.host_value is not None
        if node.value is not None:
            t.assert_kv_is(node.value, list(node.key))
        if node.host_value is not None:
            k = t.host.gather(node.host_value)[:, 0, :, 0, 0]
            expect = torch.tensor(node.key, dtype=torch.float32)
            assert torch.equal(k, torch.stack([expect + layer for layer in range(LAYERS)]))


@pytest.mark.parametrize("page,seed", [(1, 0), (1, 1), (4, 2), (4, 3)])
def test_random_operations_keep_kv_and_accounting(page, seed):
    import random

    rng = random.Random(seed)
    t = Tier(page, size=128, host=64, policy=rng.choice(["write_back", "write_through"]))
    heads = [[rng.randrange(1000, 2000) for _ in range(8 * page)] for _ in range(3)]
    for _ in range(300):
        op = rng.random()
        key = rng.choice(heads)[: rng.randrange(1, 3) * 4 * page] + [
            rng.randrange(2000, 3000) for _ in range(page * rng.randrange(0, 4))
        ]
        if op < 0.4:
            need = len(key) - t.alloc.available_size()
            if need > 0:
                t.tree.evict(need)
            if t.alloc.available_size() >= len(key):
                t.insert(key)
                if t.tree.write_policy == "write_through":
                    t.tree._write_through(tuple(key))
        elif op < 0.6:
            t.tree.evict(rng.randrange(1, 40))
        elif op < 0.85:
            t.tree.load_back(key)
        else:
            t.tree.evict_host(rng.randrange(1, 40))
        t.check()
        _assert_tree_kv(t)
    stats = t.tree.tier_stats()  # every path was taken
    assert stats["host_tokens_written"] and stats["host_tokens_loaded"] and stats["host_tokens_evicted"]
