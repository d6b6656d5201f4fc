from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from radixengine.mem_cache.accounting import (
    TokenAccountingError,
    check_token_accounting,
    token_accounting_message,
)
from radixengine.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixengine.mem_cache.chunk_cache import ChunkCache
from radixengine.mem_cache.memory_pool import ReqToTokenPool
from radixengine.mem_cache.radix_cache import RadixCache


@dataclass
class FakeReq:
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    req_pool_idx: int = -1
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    hit_counted_len: int = 0


class Setup:
    def __init__(
        self,
        page_size: int = 1,
        size: int = 256,
        chunk: bool = False,
        device: str = "cpu",
        eviction_policy: str = "lru",
    ):
        self.page_size = page_size
        self.pool = ReqToTokenPool(8, 128, device)
        if page_size == 1:
            self.alloc = TokenToKVPoolAllocator(size, torch.float16, device, None)
        else:
            self.alloc = PagedTokenToKVPoolAllocator(size, page_size, torch.float16, device, None)
        if chunk:
            self.tree = ChunkCache(self.pool, self.alloc, page_size)
        else:
            self.tree = RadixCache(self.pool, self.alloc, page_size, eviction_policy)

    def row(self, req: FakeReq, length: int) -> list[int]:
        return self.pool.req_to_token[req.req_pool_idx, :length].tolist()

    def start(self, ids: list[int]) -> FakeReq:
        """Admit a request: match, lock, take a row and write the cached prefix into it."""
        req = FakeReq(origin_input_ids=list(ids))
        match = self.tree.match_prefix(ids[:-1])  # the last prompt token is always computed
        req.prefix_indices, req.last_node = match.device_indices, match.last_node
        self.tree.inc_lock_ref(req.last_node)
        req.req_pool_idx = self.pool.alloc(1)[0]
        self.pool.write((req.req_pool_idx, slice(0, len(req.prefix_indices))), req.prefix_indices)
        return req

    def extend(self, req: FakeReq, tokens: list[int]) -> None:
        """Give KV slots to `tokens`, which follow the `len(req.prefix_indices)` tokens with KV."""
        pre = len(req.prefix_indices)
        seq = pre + len(tokens)
        if self.page_size == 1:
            slots = self.alloc.alloc(len(tokens))
        else:
            last = self.row(req, pre)[-1] if pre else -1
            slots = self.alloc.alloc_extend([pre], [seq], [last], len(tokens))
        assert slots is not None
        self.pool.write((req.req_pool_idx, slice(pre, seq)), slots)
        req.fill_ids = (req.origin_input_ids + req.output_ids)[:seq]

    def decode(self, req: FakeReq, token: int) -> None:
        """Sample `token`. The first one comes from the prefill; later ones are decode steps that
        first give KV to the previous output token."""
        if req.output_ids:
            pos = len(req.origin_input_ids) + len(req.output_ids) - 1
            if self.page_size == 1:
                slot = self.alloc.alloc(1)
            else:
                slot = self.alloc.alloc_decode([pos + 1], [self.row(req, pos)[-1]])
            self.pool.write((req.req_pool_idx, pos), slot)
        req.output_ids.append(token)

    def check(self) -> None:
        check_token_accounting(self.alloc, self.tree, self.pool)


def test_empty_tree_and_empty_key():
    s = Setup()
    match = s.tree.match_prefix([])
    assert match.device_indices.tolist() == [] and match.last_node is s.tree.root_node
    assert s.tree.match_prefix([1, 2]).device_indices.numel() == 0
    assert s.tree.insert([]) == 0
    assert s.tree.total_size() == 0 and s.tree.evictable_size() == 0
    assert s.tree.root_node.lock_ref == 1


def test_match_ending_mid_edge_splits_the_node():
    s = Setup()
    assert s.tree.insert([1, 2, 3, 4, 5], torch.tensor([11, 12, 13, 14, 15])) == 0
    match = s.tree.match_prefix([1, 2, 3, 9])
    assert match.device_indices.tolist() == [11, 12, 13]
    assert match.last_node.key == (1, 2, 3)
    (tail,) = match.last_node.children.values()
    assert tail.key == (4, 5) and tail.value.tolist() == [14, 15]
    assert s.tree.total_size() == s.tree.evictable_size() == 5
    assert s.tree.match_prefix([1, 2, 3, 4, 5, 6]).device_indices.tolist() == [11, 12, 13, 14, 15]


def test_insert_returns_the_length_already_cached():
    s = Setup()
    assert s.tree.insert([1, 2, 3, 4, 5]) == 0
    assert s.tree.insert([1, 2, 3]) == 3  # a prefix of an existing key adds nothing
    assert s.tree.total_size() == 5
    assert s.tree.insert([1, 2, 3, 7, 8]) == 3
    assert s.tree.insert([1, 2, 3, 7, 8, 9]) == 5
    assert s.tree.total_size() == 8 == s.tree.evictable_size()
    assert s.tree.match_prefix([1, 2, 3, 7]).device_indices.tolist() == [1, 2, 3, 7]
    with pytest.raises(ValueError, match="slots"):
        s.tree.insert([1, 2], torch.tensor([1]))


def test_caller_frees_duplicates_reported_by_insert():
    s = Setup(size=16)
    first = s.alloc.alloc(6)
    assert s.tree.insert([5, 6, 7, 8, 9, 10], first) == 0
    second = s.alloc.alloc(8)
    done = s.tree.insert([5, 6, 7, 8, 1, 2, 3, 4], second)
    assert done == 4
    s.alloc.free(second[:done])
    s.check()
    assert s.tree.match_prefix([5, 6, 7, 8, 1]).device_indices.tolist() == first[:4].tolist() + [
        second[4].item()
    ]


@pytest.mark.parametrize("page_size", [4, 16])
def test_pages_align_keys_and_splits(page_size):
    s = Setup(page_size=page_size, size=page_size * 16)
    ps = page_size
    key = list(range(100, 100 + 2 * ps + 3))  # not a multiple of the page
    assert s.tree.insert(key) == 0
    assert s.tree.total_size() == 2 * ps
    assert s.tree.match_prefix(key).device_indices.tolist() == key[: 2 * ps]
    assert s.tree.match_prefix(key[: ps - 1]).device_indices.numel() == 0

    other = key[: ps + 1] + [7] * (ps + 2)  # differs inside the second page
    match = s.tree.match_prefix(other)
    assert match.device_indices.tolist() == key[:ps]
    assert len(match.last_node.key) == ps
    assert s.tree.insert(other) == ps
    assert s.tree.total_size() == 3 * ps
    assert {len(c.key) for c in match.last_node.children.values()} == {ps}
    assert s.tree.match_prefix(other).device_indices.tolist() == other[: 2 * ps]


def test_lock_refs_protect_from_eviction():
    s = Setup(size=32)
    slots = s.alloc.alloc(6)
    s.tree.insert([1, 2, 3, 4, 5, 6], slots)
    node = s.tree.match_prefix([1, 2, 3]).last_node  # splits 3 | 3
    assert s.tree.inc_lock_ref(node) == -3
    assert (s.tree.protected_size(), s.tree.evictable_size()) == (3, 3)
    assert s.tree.inc_lock_ref(node) == 0
    assert s.tree.evict(100) == 3  # only the unlocked tail goes
    assert s.tree.evictable_size() == 0 and s.tree.total_size() == 3
    assert s.alloc.available_size() == 32 - 3
    assert s.tree.dec_lock_ref(node) == 0
    assert s.tree.protected_size() == 3
    assert s.tree.dec_lock_ref(node) == 3
    assert (s.tree.protected_size(), s.tree.evictable_size()) == (0, 3)
    with pytest.raises(RuntimeError, match="not locked"):
        s.tree.dec_lock_ref(node)
    assert s.tree.root_node.lock_ref == 1 and node.lock_ref == 0
    assert s.tree.evict(1) == 3
    with pytest.raises(ValueError, match="not in this tree"):
        s.tree.inc_lock_ref(node)
    s.check()


def test_evict_is_lru_over_leaves_and_frees_whole_nodes():
    s = Setup(size=32)
    keys = {name: [base + i for i in range(4)] for name, base in (("a", 10), ("b", 20), ("c", 30))}
    for key in keys.values():
        s.tree.insert(key, s.alloc.alloc(4))
    s.tree.match_prefix(keys["a"])  # a is now the most recent
    assert s.tree.evict(1) == 4  # whole node, more than asked
    assert s.tree.match_prefix(keys["b"]).device_indices.numel() == 0
    assert s.tree.match_prefix(keys["c"]).device_indices.numel() == 4
    assert s.tree.evict(5) == 8  # a (older than the c just matched), then c
    assert s.tree.total_size() == 0 and s.alloc.available_size() == 32
    assert s.tree.evict(5) == 0


def test_evict_leaf_tails_frees_only_the_pages_asked_for():
    """Soft preemption's eviction: the LRU leaf loses its last tokens, its head stays matchable
    (and evictable, with the same key), and the accounting holds."""
    alloc = TokenToKVPoolAllocator(32, torch.float16, "cpu", None)
    tree = RadixCache(None, alloc, evict_leaf_tails=True)
    old, new = list(range(10, 18)), list(range(30, 34))
    tree.insert(old, alloc.alloc(8))
    tree.insert(new, alloc.alloc(4))
    assert tree.evict(3) == 3
    assert tree.match_prefix(old).device_indices.numel() == 5
    assert tree.match_prefix(new).device_indices.numel() == 4
    assert tree.evictable_size() == 9 == tree.total_size() and alloc.available_size() == 32 - 9
    assert tree.evict(6) == 6  # the old head (5 tokens, its last access was before new's), then 1 of new
    assert tree.match_prefix(new).device_indices.numel() == 3 and alloc.available_size() == 32 - 3


def _three_keys(policy: str) -> tuple[RadixCache, Any, dict[str, list[int]]]:
    alloc = TokenToKVPoolAllocator(32, torch.float16, "cpu", None)
    tree = RadixCache(None, alloc, eviction_policy=policy)
    keys = {name: [base + i for i in range(4)] for name, base in (("a", 10), ("b", 20), ("c", 30))}
    return tree, alloc, keys


def _survivors(tree: RadixCache, keys: dict[str, list[int]]) -> set[str]:
    return {name for name, key in keys.items() if len(tree.match_prefix(key).device_indices) == 4}


def test_lfu_evicts_the_least_inserted_prefix_first():
    tree, alloc, keys = _three_keys("lfu")
    tree.insert(keys["a"], alloc.alloc(4))
    for _ in range(2):  # b inserted three times: a hot system prompt
        dup = alloc.alloc(4)
        alloc.free(dup[: tree.insert(keys["b"], dup)])
    tree.insert(keys["c"], alloc.alloc(4))  # the most recent, but inserted once
    dup = alloc.alloc(4)
    alloc.free(dup[: tree.insert(keys["b"], dup)])
    assert tree.evict(4) == 4 and _survivors(tree, keys) == {"b", "c"}  # a: once, and the oldest
    assert tree.evict(4) == 4 and _survivors(tree, keys) == {"b"}  # LRU would have evicted b here


def test_slru_protects_prefixes_hit_twice():
    tree, alloc, keys = _three_keys("slru")
    tree.insert(keys["a"], alloc.alloc(4))
    dup = alloc.alloc(4)
    alloc.free(dup[: tree.insert(keys["a"], dup)])  # a: protected (2 hits)
    tree.insert(keys["b"], alloc.alloc(4))
    tree.insert(keys["c"], alloc.alloc(4))
    assert tree.evict(8) == 8 and _survivors(tree, keys) == {"a"}  # the probationary ones go first


def test_slru_reinserts_by_the_same_request_are_no_hits():
    tree, alloc, keys = _three_keys("slru")
    tree.insert(keys["a"], alloc.alloc(4))
    dup = alloc.alloc(4)
    alloc.free(dup[: tree.insert(keys["a"], dup, counted_len=4)])  # the same request, again
    tree.insert(keys["b"], alloc.alloc(4))
    assert tree.evict(4) == 4 and _survivors(tree, keys) == {"b"}


def serve(s: Setup, prompt: list[int], chunk: int | None = None) -> None:
    """One request's life: its prompt prefilled (in chunks of `chunk`), two tokens decoded,
    finished."""
    req = s.start(prompt)
    step = chunk or len(prompt)
    while len(req.prefix_indices) < len(prompt):
        s.extend(req, prompt[len(req.prefix_indices) : len(req.prefix_indices) + step])
        s.tree.cache_unfinished_req(req)
    s.decode(req, 1)
    s.decode(req, 2)
    s.tree.cache_finished_req(req)


@pytest.mark.parametrize("chunk", [None, 3])
def test_slru_protects_what_distinct_requests_share_not_a_single_use_prompt(chunk):
    """A request inserts its prompt after the prefill (each chunk) and again when it finishes:
    one request, one hit. The prompt two requests shared is protected; a single-use prompt
    served after it is evicted first although it is more recent (counted as two hits, it was
    protected too, and the shared prompt, older, went first)."""
    s = Setup(eviction_policy="slru")
    shared, single = list(range(10, 20)), list(range(30, 40))
    serve(s, shared, chunk)
    serve(s, shared, chunk)
    serve(s, single, chunk)
    hits = {
        name: s.tree.match_prefix(p).last_node.hit_count
        for name, p in (("shared", shared), ("single", single))
    }
    assert hits == {"shared": 2, "single": 1}
    assert s.tree.evict(11) == 11  # the single-use prompt and its output token
    assert len(s.tree.match_prefix(single).device_indices) == 0
    assert len(s.tree.match_prefix(shared).device_indices) == 10
    s.check()


def test_priority_eviction_takes_low_priority_prefixes_first():
    tree, alloc, keys = _three_keys("priority")
    tree.insert(keys["a"], alloc.alloc(4), priority=5)
    tree.insert(keys["b"], alloc.alloc(4), priority=0)
    tree.insert(keys["c"], alloc.alloc(4), priority=-1)
    tree.match_prefix(keys["c"])  # recency does not save a lower priority
    assert tree.evict(4) == 4 and _survivors(tree, keys) == {"a", "b"}
    assert tree.evict(4) == 4 and _survivors(tree, keys) == {"a"}


def test_priority_of_a_shared_prefix_is_its_highest_user():
    tree, alloc, _ = _three_keys("priority")
    tree.insert([1, 2, 3, 4], alloc.alloc(4), priority=0)
    dup = alloc.alloc(6)
    alloc.free(dup[: tree.insert([1, 2, 3, 4, 5, 6], dup, priority=9)])
    tree.insert([7, 8], alloc.alloc(2), priority=3)
    assert tree.evict(1) == 2 and tree.match_prefix([7, 8]).device_indices.numel() == 0
    assert tree.match_prefix([1, 2, 3, 4]).last_node.priority == 9


def test_unknown_eviction_policy_raises():
    with pytest.raises(ValueError, match="radix eviction policy 'mru'"):
        RadixCache(None, None, eviction_policy="mru")


def test_parent_becomes_evictable_after_its_children():
    s = Setup(size=32)
    s.tree.insert([1, 2, 3, 4], s.alloc.alloc(4))
    dup = s.alloc.alloc(6)
    done = s.tree.insert([1, 2, 3, 4, 5, 6], dup)
    s.alloc.free(dup[:done])
    s.tree.match_prefix([1, 2, 3, 4, 5, 6])
    assert s.tree.evict(2) == 2
    assert s.tree.total_size() == 4
    assert s.tree.evict(1) == 4
    s.check()


def test_bad_keys_and_sizes_raise():
    s = Setup()
    for bad in ("abc", [1, "a"], [1.0, 2.0], [3, 2.5], [None], [np.float32(1)], torch.tensor([1, 2]), None):
        with pytest.raises(TypeError):
            s.tree.match_prefix(bad)
    with pytest.raises(TypeError):
        s.tree.insert("abc")
    assert s.tree.insert(tuple(np.array([3, 4], dtype=np.int64))) == 0
    assert s.tree.match_prefix([3, 4]).device_indices.tolist() == [3, 4]
    with pytest.raises(ValueError):
        s.tree.evict(-1)
    with pytest.raises(ValueError):
        RadixCache(s.pool, s.alloc, page_size=0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_request_lifecycle_shares_prefixes_and_keeps_accounting(page_size):
    check_lifecycle(page_size, "cpu")


def check_lifecycle(page_size: int, device: str) -> None:
    s = Setup(page_size=page_size, device=device)
    prompt = list(range(40, 50))
    a = s.start(prompt)
    s.extend(a, prompt)
    s.tree.cache_unfinished_req(a)
    aligned = len(prompt) // page_size * page_size
    assert len(a.prefix_indices) == len(prompt)
    assert s.tree.protected_size() == aligned and s.tree.evictable_size() == 0
    for token in (1, 2, 3):
        s.decode(a, token)

    b = s.start(prompt + [5, 6])
    assert b.prefix_indices.tolist() == s.row(a, aligned)
    s.extend(b, (prompt + [5, 6])[len(b.prefix_indices) :])
    s.tree.cache_unfinished_req(b)
    s.decode(b, 8)

    s.tree.cache_finished_req(a)  # caches prompt + [1, 2]; the last token has no KV
    cached = s.tree.match_prefix(prompt + [1, 2, 3]).device_indices
    assert len(cached) == (len(prompt) + 2) // page_size * page_size
    assert s.tree.protected_size() == (len(prompt) + 2) // page_size * page_size
    s.tree.cache_finished_req(b, is_insert=False)  # retracted: its own slots are freed
    assert s.tree.protected_size() == 0
    assert s.tree.total_size() == s.tree.evictable_size() == {1: 14, 4: 16}[page_size]
    s.check()
    s.tree.evict(10_000)
    assert s.alloc.available_size() == s.alloc.size


@pytest.mark.parametrize("page_size", [1, 4])
def test_unfinished_req_row_points_at_canonical_slots(page_size):
    """Two requests prefill the same prompt at once; the second one's duplicate slots are freed and
    its row must be rewritten to the tree's slots, including a shared partial page."""
    check_canonical_rows(page_size, "cpu")


def check_canonical_rows(page_size: int, device: str) -> None:
    s = Setup(page_size=page_size, device=device)
    prompt = list(range(60, 70))
    a, b = s.start(prompt), s.start(prompt)
    for req in (a, b):  # first chunk: 6 tokens
        s.extend(req, prompt[:6])
    s.tree.cache_unfinished_req(a)
    s.tree.cache_unfinished_req(b)
    owned = 6 // page_size * page_size
    assert s.row(b, owned) == s.row(a, owned)
    for req in (a, b):  # second chunk: the rest
        s.extend(req, prompt[len(req.prefix_indices) :])
    s.tree.cache_unfinished_req(a)
    s.tree.cache_unfinished_req(b)
    aligned = 10 // page_size * page_size
    assert s.row(b, aligned) == s.row(a, aligned)
    b_slots = torch.tensor(s.row(b, 10), device=device)
    assert not s.alloc.free_mask[b_slots // page_size].any()  # nothing b uses is free
    assert s.tree.total_size() == aligned and s.tree.protected_size() == aligned
    for req in (a, b):
        s.decode(req, 1)
        s.tree.cache_finished_req(req)
    s.check()


def test_accounting_error_names_the_difference():
    s = Setup(size=16)
    s.tree.insert([1, 2, 3], s.alloc.alloc(3))
    s.alloc.alloc(2)  # two slots nobody owns
    row = s.pool.alloc(1)
    message = token_accounting_message(s.alloc, s.tree, s.pool)
    assert "available 11 + evictable 3 + protected 0 = 14 != size 16" in message
    assert "difference -2" in message and "leaked" in message
    assert f"rows still in use: 1 of 8: {row}" in message
    with pytest.raises(TokenAccountingError, match="difference -2"):
        check_token_accounting(s.alloc, s.tree, s.pool)
    with pytest.raises(AssertionError):
        check_token_accounting(s.alloc, s.tree)


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunk_cache_shares_nothing(page_size):
    s = Setup(page_size=page_size, chunk=True)
    assert s.tree.disable and not RadixCache.disable
    prompt = list(range(10))
    req = s.start(prompt)
    assert req.prefix_indices.numel() == 0 and req.last_node is None
    s.extend(req, prompt[:6])
    s.tree.cache_unfinished_req(req)
    assert req.prefix_indices.tolist() == s.row(req, 6)
    assert s.tree.protected_size() == 6
    s.extend(req, prompt[6:])
    s.tree.cache_unfinished_req(req)
    assert s.tree.protected_size() == 10
    s.decode(req, 3)
    assert s.tree.evict(100) == 0 and s.tree.evictable_size() == 0 and s.tree.insert([1]) == 0
    s.tree.cache_finished_req(req)
    assert s.tree.match_prefix(prompt).device_indices.numel() == 0
    assert s.tree.total_size() == 0
    s.check()
    with pytest.raises(TypeError):
        s.tree.match_prefix("abc")


def test_pretty_print_and_reset(capsys):
    s = Setup()
    s.tree.insert([1, 2, 3])
    s.tree.insert([1, 2, 4])
    s.tree.pretty_print()
    out = capsys.readouterr().out
    assert "#tokens: 4" in out and "[1, 2]" in out
    s.tree.reset()
    assert s.tree.total_size() == 0 and s.tree.match_prefix([1, 2]).device_indices.numel() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page_size", [1, 4])
def test_request_flows_on_cuda(page_size):
    check_lifecycle(page_size, "cuda")
    check_canonical_rows(page_size, "cuda")
    s = Setup(page_size=page_size, device="cuda")
    s.tree.insert([1, 2, 3, 4, 5, 6, 7, 8], s.alloc.alloc(8))
    match = s.tree.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert match.device_indices.device.type == "cuda" and len(match.device_indices) == 8
    assert s.tree.evict(8) == 8 and s.alloc.available_size() == s.alloc.size


@pytest.mark.parametrize("page_size", [1, 4])
def test_extra_keys_are_separate_namespaces(page_size):
    """The same tokens under another extra key (a LoRA adapter) never match; splits and eviction
    keep each node in its namespace."""
    alloc = TokenToKVPoolAllocator(64, torch.float16, "cpu", None)
    cache = RadixCache(None, alloc, page_size=page_size)
    tokens = list(range(1, 9))
    a, base, a2 = alloc.alloc(8), alloc.alloc(8), alloc.alloc(8)
    cache.insert(tokens, a, extra_key="a")
    assert len(cache.match_prefix(tokens).device_indices) == 0
    assert len(cache.match_prefix(tokens, "b").device_indices) == 0
    assert cache.match_prefix(tokens[:4], "a").device_indices.tolist() == a[:4].tolist()  # a split
    assert cache.insert(tokens, base) == 0  # the base namespace had none of it
    assert cache.insert(tokens[:4] + [99] * 4, a2, extra_key="a") == 4
    alloc.free(a2[:4])
    assert cache.match_prefix(tokens, "a").device_indices.tolist() == a.tolist()
    assert cache.match_prefix(tokens).device_indices.tolist() == base.tolist()
    assert cache.evictable_size() == 8 + 8 + 4
    assert cache.evict(100) == 20
    assert cache.evictable_size() == 0 and not cache.root_node.children
    assert alloc.available_size() == 64
