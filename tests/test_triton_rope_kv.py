"""The Triton rotary embedding (in place) and K/V write against their torch forms, bit for bit:
fp32 and bf16, partial rotary, q and k heads as a view of the fused qkv output. On a CPU under
TRITON_INTERPRET=1 (tests/test_triton_interpreted.py runs it so)."""

from __future__ import annotations

import os

import pytest
import torch

from radixengine.layers.rotary_embedding import RotaryEmbedding

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1",
    reason="on a CPU under TRITON_INTERPRET=1 only (tests/test_triton_interpreted.py runs it so)",
)


def assert_equal_as_rounded(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit for bit, except for 16-bit results in Triton's interpreter, whose conversions from
    fp32 truncate instead of rounding to nearest (Triton 3.9): there within a few units of the
    last place of the inputs (|x| < 5), which the sums' cancellation can make large relatively."""
    if got.dtype == torch.float32 or got.is_cuda:
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-6, atol=2**-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size,rotary_dim", [(16, 16), (32, 16), (24, 24)])
def test_rotary_in_place_equals_the_torch_form(dtype, head_size, rotary_dim):
    from radixengine.layers.triton_ops.rope_kv import rotary_in_place

    torch.manual_seed(head_size + rotary_dim)
    rope = RotaryEmbedding(head_size, rotary_dim, 64, 10000.0, dtype).to(DEVICE)
    heads, kv_heads = 4, 2
    qkv = torch.randn(7, heads + 2 * kv_heads, head_size, device=DEVICE).to(dtype)
    qk = qkv[:, : heads + kv_heads]  # a view, as the model passes it
    positions = torch.tensor([0, 3, 9, 1, 63, 20, 5], device=DEVICE)
    v_before = qkv[:, heads + kv_heads :].clone()
    cos, sin = rope._cos_sin(positions)
    half = rotary_dim // 2
    x1, x2 = qk[..., :half], qk[..., half:rotary_dim]
    expected = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, qk[..., rotary_dim:]), dim=-1)
    out = rotary_in_place(positions, qk, rope.cos_sin_cache, rotary_dim)
    assert out.data_ptr() == qk.data_ptr()
    assert_equal_as_rounded(out, expected)
    assert torch.equal(qkv[:, heads + kv_heads :], v_before)  # v untouched


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_store_kv_equals_index_put(pool_dtype):
    from radixengine.layers.triton_ops.rope_kv import store_kv

    torch.manual_seed(1)
    qkv = torch.randn(5, 8, 16, device=DEVICE)
    k, v = qkv[:, 4:6], qkv[:, 6:]
    k_buf = torch.zeros(20, 2, 16, dtype=pool_dtype, device=DEVICE)
    v_buf = torch.zeros_like(k_buf)
    loc = torch.tensor([3, 17, 0, 9, 10], device=DEVICE)
    store_kv(k, v, k_buf, v_buf, loc)
    k_ref, v_ref = torch.zeros_like(k_buf), torch.zeros_like(v_buf)
    k_ref[loc], v_ref[loc] = k.to(pool_dtype), v.to(pool_dtype)
    assert_equal_as_rounded(k_buf, k_ref)
    assert_equal_as_rounded(v_buf, v_ref)
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[loc.cpu()] = False
    assert not k_buf[untouched.to(DEVICE)].any() and not v_buf[untouched.to(DEVICE)].any()
