"""Radix namespaces (LoRA adapters' `extra_key`) through the hierarchical cache's tiers on a CPU
pool: the same token ids cached under adapter "A" are matched, loaded back from the host and
read from storage under "A" only (with A's KV bytes), never under "B" or the base model (None);
the base model's storage page keys are those of `page_keys` without a namespace."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixengine.managers.req import Req
from radixengine.mem_cache.accounting import check_token_accounting
from radixengine.mem_cache.allocator import TokenToKVPoolAllocator
from radixengine.mem_cache.hiradix_cache import HiRadixCache, PrefetchConfig
from radixengine.mem_cache.host_radix_cache import HostRadixCache
from radixengine.mem_cache.memory_pool import MHATokenToKVPool
from radixengine.mem_cache.memory_pool_host import HostKVPool
from radixengine.mem_cache.storage.base import KVIdentity, page_keys
from radixengine.mem_cache.storage.file_backend import HiCacheFile
from radixengine.sampling.sampling_params import SamplingParams

LAYERS, HEADS, DIM, PT = 2, 2, 4, 16
TOKENS = list(range(100, 140))  # two whole storage pages and a tail
NAMESPACES = {None: 0.0, "A": 1000.0, "B": 2000.0}  # what each namespace's KV adds to the ids


class Tiers:
    """A device pool, optionally a host pool, optionally storage in `folder`."""

    def __init__(self, folder: Path | None = None, host: int = 0, size: int = 128) -> None:
        self.pool = MHATokenToKVPool(size, 1, torch.float32, HEADS, DIM, LAYERS, "cpu")
        self.alloc = TokenToKVPoolAllocator(size, torch.float32, "cpu", self.pool)
        host_pool = HostKVPool.like(self.pool, host) if host else None
        if folder is None:
            self.tree = HostRadixCache(None, self.alloc, 1, host_pool=host_pool, write_policy="write_back")
            return
        self.storage = HiCacheFile(folder, KVIdentity("m", "float32", PT, LAYERS, HEADS, DIM))
        self.tree = HiRadixCache(
            None,
            self.alloc,
            1,
            self.storage,
            write_policy="write_back",
            prefetch=PrefetchConfig("wait_complete"),
            host_pool=host_pool,
        )

    def insert(self, tokens: list[int], ns: str | None) -> None:
        """Insert `tokens` in namespace `ns` with KV naming both (K = id + NAMESPACES[ns])."""
        slots = self.alloc.alloc(len(tokens))
        kv = (torch.tensor(tokens, dtype=torch.float32) + NAMESPACES[ns])[:, None, None].expand(
            -1, HEADS, DIM
        )
        for layer in range(LAYERS):
            self.pool.set_kv_buffer(layer, slots, kv + layer, -kv - layer)
        present = self.tree.insert(tokens, slots, extra_key=ns)
        self.alloc.free(slots[:present])

    def match(self, tokens: list[int], ns: str | None) -> torch.Tensor:
        return self.tree.match_prefix(tokens, ns).device_indices

    def assert_kv_of(self, ns: str | None, tokens: list[int]) -> None:
        """The device match of `tokens` under `ns` holds `ns`'s KV of them."""
        slots = self.match(tokens, ns)
        expect = (torch.tensor(tokens[: len(slots)], dtype=torch.float32) + NAMESPACES[ns])[:, None, None]
        for layer in range(LAYERS):
            assert torch.equal(self.pool.k_buffer[layer][slots], expect.expand(-1, HEADS, DIM) + layer)

    def evict_all(self) -> None:
        self.tree.evict(self.tree.evictable_size())
        assert self.tree.evictable_size() == 0

    def load(self, tokens: list[int], ns: str | None, rid: str) -> int:
        """What admission does for a request of `tokens` under `ns`: prefetch, match, load."""
        req = Req(rid, None, tokens + [1], SamplingParams(max_new_tokens=1), lora_id=ns)
        self.tree.prefetch_from_storage(rid, req.origin_input_ids, req.extra_key)
        op = self.tree.prefetcher.get(rid) if isinstance(self.tree, HiRadixCache) else None
        if op is not None:
            op.wait(30)
        req.init_next_round_input(self.tree)
        return self.tree.load_from_storage(req, req.fill_ids[: req.max_prefix_len()])

    def check(self) -> None:
        check_token_accounting(self.alloc, self.tree)


def test_device_matches_stay_in_their_namespace():
    t = Tiers()
    t.insert(TOKENS, "A")
    assert len(t.match(TOKENS, "A")) == len(TOKENS)
    assert len(t.match(TOKENS, "B")) == 0 and len(t.match(TOKENS, None)) == 0
    t.check()


def test_host_tier_serves_a_node_to_its_own_namespace_only():
    t = Tiers(host=128)
    t.insert(TOKENS, "A")
    t.insert(TOKENS, None)  # the same ids, the base model's KV
    t.evict_all()
    assert t.tree.tier_stats()["host_pool_used_tokens"] == 2 * len(TOKENS)
    assert t.load(TOKENS, "B", "b") == 0 and len(t.match(TOKENS, "B")) == 0
    assert t.load(TOKENS, "A", "a") == len(TOKENS)
    t.assert_kv_of("A", TOKENS)
    assert len(t.match(TOKENS, None)) == 0  # A's load brought nothing of the base model's
    assert t.load(TOKENS, None, "n") == len(TOKENS)
    t.assert_kv_of(None, TOKENS)
    t.check()


def test_recomputing_a_host_node_revives_it_in_its_namespace():
    t = Tiers(host=128)
    t.insert(TOKENS, "A")
    t.evict_all()
    t.insert(TOKENS, "B")  # B computes the same ids: a node of its own, A's stays on the host
    assert t.tree.tier_stats()["host_pool_used_tokens"] == len(TOKENS)
    t.insert(TOKENS, "A")  # A recomputes them: its host node gets device slots again
    t.assert_kv_of("A", TOKENS)
    t.assert_kv_of("B", TOKENS)
    t.check()


def test_the_full_host_pool_evicts_namespaced_nodes():
    t = Tiers(host=len(TOKENS))
    t.insert(TOKENS, "A")
    t.evict_all()
    t.insert(TOKENS, "B")
    t.evict_all()  # B's node needs A's host slots: A's node leaves the tree
    assert t.load(TOKENS, "A", "a") == 0
    assert t.load(TOKENS, "B", "b") == len(TOKENS)
    t.assert_kv_of("B", TOKENS)
    t.check()


def test_storage_pages_are_read_in_their_namespace_only(tmp_path):
    t = Tiers(tmp_path)
    t.insert(TOKENS, "A")
    t.evict_all()  # write_back: A's two pages go to storage, the nodes leave the tree
    t.tree.flush_storage()
    base_keys = page_keys(tuple(TOKENS), PT, 2)
    a_keys = t.tree._page_keys(tuple(TOKENS), 2, "A")
    assert not set(a_keys) & set(base_keys + t.tree._page_keys(tuple(TOKENS), 2, "B"))
    assert all(t.storage.exists(k) for k in a_keys) and not any(t.storage.exists(k) for k in base_keys)
    assert t.load(TOKENS, "B", "b") == 0 and t.load(TOKENS, None, "n") == 0
    assert t.load(TOKENS, "A", "a") == 2 * PT
    t.assert_kv_of("A", TOKENS[: 2 * PT])
    assert len(t.match(TOKENS, None)) == 0 and len(t.match(TOKENS, "B")) == 0
    t.check()
    t.tree.close()


def test_base_page_keys_are_unchanged_and_survive_a_restart(tmp_path):
    first = Tiers(tmp_path)
    first.insert(TOKENS, None)
    first.insert(TOKENS, "A")
    first.evict_all()
    first.tree.flush_storage()
    assert first.tree._page_keys(tuple(TOKENS), 2, None) == page_keys(tuple(TOKENS), PT, 2)
    assert all(first.storage.exists(k) for k in page_keys(tuple(TOKENS), PT, 2))
    first.tree.close()
    # A restart: the base model's pages are read again; adapter ids name one load, so A's are not.
    second = Tiers(tmp_path)
    assert second.tree._page_keys(tuple(TOKENS), 2, "A") != first.tree._page_keys(tuple(TOKENS), 2, "A")
    assert second.load(TOKENS, "A", "a") == 0
    assert second.load(TOKENS, None, "n") == 2 * PT
    second.assert_kv_of(None, TOKENS[: 2 * PT])
    second.check()
    second.tree.close()


@pytest.mark.parametrize("host", [0, 128])
def test_write_through_keeps_the_namespace_of_each_path(tmp_path, host):
    t = Tiers(tmp_path, host=host)
    t.insert(TOKENS, "A")
    t.tree._write_path(tuple(TOKENS), "A")
    if host:
        t.tree._write_through(tuple(TOKENS), "A")
        t.tree._write_through(tuple(TOKENS), "B")  # no path of B's: nothing
        assert t.tree.tier_stats()["host_pool_used_tokens"] == len(TOKENS)
    t.tree.flush_storage()
    assert all(t.storage.exists(k) for k in t.tree._page_keys(tuple(TOKENS), 2, "A"))
    t.tree._write_path(tuple(TOKENS), None)  # no path of the base model's: nothing written
    t.tree.flush_storage()
    assert not any(t.storage.exists(k) for k in page_keys(tuple(TOKENS), PT, 2))
    t.check()
    t.tree.close()


def test_pages_keyed_by_adapter_weights_survive_a_restart(tmp_path):
    """With the adapters' weight digests (as the scheduler gives them), an adapter's pages are read
    after a restart, by any id of the same weights, and never by an adapter of other weights."""
    first = Tiers(tmp_path)
    first.tree.set_namespace_digests({"A": b"weights of A"}.get)
    first.insert(TOKENS, "A")
    first.evict_all()
    first.tree.flush_storage()
    first.tree.close()
    second = Tiers(tmp_path)
    digests = {"A": b"weights of A", "A again": b"weights of A", "B": b"weights of B"}
    second.tree.set_namespace_digests(digests.get)
    assert second.load(TOKENS, "B", "b") == 0 and second.load(TOKENS, None, "n") == 0
    assert second.load(TOKENS, "A", "a") == 2 * PT
    second.assert_kv_of("A", TOKENS[: 2 * PT])
    NAMESPACES["A again"] = NAMESPACES["A"]  # the same weights: the same KV
    try:
        assert second.load(TOKENS, "A again", "a2") == 2 * PT
        second.assert_kv_of("A again", TOKENS[: 2 * PT])
    finally:
        del NAMESPACES["A again"]
    second.check()
    second.tree.close()
