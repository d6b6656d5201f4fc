from __future__ import annotations

import pytest
import torch

from radixengine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


def test_req_to_token_pool_alloc_free_write():
    pool = ReqToTokenPool(size=4, max_context_len=8, device="cpu")
    assert pool.req_to_token.shape == (4, 8) and pool.req_to_token.dtype == torch.int32
    assert pool.alloc(3) == [0, 1, 2]
    assert pool.available_size() == 1
    assert pool.alloc(2) is None
    assert pool.available_size() == 1

    pool.write((1, slice(2, 5)), torch.tensor([7, 8, 9]))
    assert pool.req_to_token[1].tolist() == [0, 0, 7, 8, 9, 0, 0, 0]

    pool.free(1)
    pool.free([0, 2])
    assert pool.available_size() == 4
    assert sorted(pool.alloc(4)) == [0, 1, 2, 3]
    pool.clear()
    assert pool.available_size() == 4 and pool.used_rows() == []


def test_req_to_token_pool_rejects_bad_frees_and_sizes():
    pool = ReqToTokenPool(size=3, max_context_len=4, device="cpu")
    rows = pool.alloc(2)
    pool.free(rows[0])
    with pytest.raises(ValueError, match="double free"):
        pool.free(rows[0])
    with pytest.raises(ValueError, match="not in"):
        pool.free(3)
    with pytest.raises(ValueError, match="not in"):
        pool.free(-1)
    with pytest.raises(ValueError, match="repeat"):
        pool.free([rows[1], rows[1]])
    assert pool.used_rows() == [rows[1]]
    with pytest.raises(ValueError):
        pool.alloc(-1)
    with pytest.raises(ValueError):
        ReqToTokenPool(size=0, max_context_len=4, device="cpu")
    with pytest.raises(ValueError):
        ReqToTokenPool(size=2, max_context_len=-4, device="cpu")


def test_mha_token_to_kv_pool_buffers():
    pool = MHATokenToKVPool(
        size=16, page_size=4, dtype=torch.float16, head_num=2, head_dim=8, layer_num=3, device="cpu"
    )
    assert len(pool.k_buffer) == len(pool.v_buffer) == 3
    assert pool.get_key_buffer(0).shape == (20, 2, 8)
    assert pool.get_value_buffer(2).dtype == torch.float16

    loc = torch.tensor([4, 7])
    k = torch.arange(32, dtype=torch.float32).reshape(2, 2, 8)
    v = -k.reshape(2, 16)  # flattened heads are accepted too
    pool.set_kv_buffer(1, loc, k, v)
    key_buf, value_buf = pool.get_kv_buffer(1)
    assert torch.equal(key_buf[loc], k.half())
    assert torch.equal(value_buf[loc], -k.half())
    assert key_buf[0].abs().sum() == 0 and pool.get_key_buffer(0)[loc].abs().sum() == 0
    k_bytes, v_bytes = pool.get_kv_size_bytes()
    assert k_bytes == v_bytes == 3 * 20 * 2 * 8 * 2

    with pytest.raises(ValueError):
        MHATokenToKVPool(16, 0, torch.float16, 2, 8, 1, "cpu")
