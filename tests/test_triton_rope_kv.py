"""The Triton rotary embedding (in place), alone and with the K/V write in its launch, and the
K/V write alone against their torch forms, bit for bit: fp32, fp16 and bf16, partial rotary, GQA,
q and k heads as a view of the fused qkv output. On a CPU under TRITON_INTERPRET=1
(tests/test_triton_interpreted.py runs it so)."""

from __future__ import annotations

import pytest
import torch
from triton_test_utils import DEVICE, on_gpu_or_interpreted

from radixengine.layers.rotary_embedding import RotaryEmbedding

pytest.importorskip("triton")
pytestmark = on_gpu_or_interpreted


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


def rotated(qk: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor) -> torch.Tensor:
    """The torch rotary of `qk` `[tokens, heads, head_size]`: products in the tensor's dtype."""
    cos, sin = rope._cos_sin(positions)
    half = rope.rotary_dim // 2
    x1, x2 = qk[..., :half], qk[..., half : rope.rotary_dim]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, qk[..., rope.rotary_dim :]), dim=-1)


@pytest.mark.parametrize(
    "dtype,pool_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)]
    + [(torch.float32, torch.bfloat16)],
)
@pytest.mark.parametrize(
    "heads,kv_heads,head_size,rotary_dim", [(4, 2, 16, 16), (4, 4, 32, 16), (6, 2, 24, 24), (3, 1, 16, 8)]
)
def test_rotary_store_kv_equals_rotary_then_index_put(
    dtype, pool_dtype, heads, kv_heads, head_size, rotary_dim
):
    """One launch: q and k rotated in place as the torch form (and as the rotary alone, bit for
    bit), the rotated k and v written at `loc` as the separate K/V write does, no other slot."""
    from radixengine.layers.triton_ops.rope_kv import rotary_in_place, rotary_store_kv, store_kv

    torch.manual_seed(heads * head_size + rotary_dim)
    rope = RotaryEmbedding(head_size, rotary_dim, 64, 10000.0, dtype).to(DEVICE)
    qkv = torch.randn(5, heads + 2 * kv_heads, head_size, device=DEVICE).to(dtype)
    qk, v = qkv[:, : heads + kv_heads], qkv[:, heads + kv_heads :]  # views, as the model passes them
    positions = torch.tensor([0, 3, 9, 63, 20], device=DEVICE)
    loc = torch.tensor([3, 17, 0, 9, 10], device=DEVICE)
    expected = rotated(qk, rope, positions)
    unfused = rotary_in_place(positions, qk.clone(), rope.cos_sin_cache, rotary_dim)
    v_before = v.clone()
    buffers = [torch.zeros(20, kv_heads, head_size, dtype=pool_dtype, device=DEVICE) for _ in range(4)]
    k_buf, v_buf, k_ref, v_ref = buffers
    store_kv(unfused[:, heads:], v, k_ref, v_ref, loc)

    out = rotary_store_kv(positions, qk, rope.cos_sin_cache, rotary_dim, v, k_buf, v_buf, loc)
    assert out.data_ptr() == qk.data_ptr()
    assert_equal_as_rounded(qk, expected)
    assert torch.equal(qk, unfused)
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)
    assert torch.equal(v, v_before)
    if pool_dtype == dtype:
        assert torch.equal(k_buf[loc], qk[:, heads:]) and torch.equal(v_buf[loc], v)
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[loc.cpu()] = False
    assert not k_buf[untouched.to(DEVICE)].any() and not v_buf[untouched.to(DEVICE)].any()


@pytest.mark.parametrize("arch,page_size", [("llama", 1), ("llama", 16), ("qwen3", 1), ("phi3", 16)])
def test_models_write_kv_in_the_rotary_launch(arch, page_size, tmp_path, monkeypatch):
    """A model on the Triton path writes K/V in the rotary's launch (Qwen 3: k normed per head
    first; Phi-3: partial rotary), and its prefill, decode logits and KV pool equal those of the
    separate rotary and K/V write, bit for bit."""
    from model_utils import ModelDriver, make_runner, save_tiny_model

    from radixengine.layers.native_small_ops import native_small_ops
    from radixengine.layers.triton_ops import rope_kv
    from radixengine.models.llama import LlamaAttention

    save_tiny_model(arch, tmp_path, seed=2)
    fused_launches = []
    rotary_store_kv = rope_kv.rotary_store_kv
    monkeypatch.setattr(
        rope_kv, "rotary_store_kv", lambda *a: fused_launches.append(1) or rotary_store_kv(*a)
    )

    def run() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        runner = make_runner(tmp_path, page_size, device=DEVICE, attention_backend="triton")
        driver = ModelDriver(runner)
        with native_small_ops(False):  # the torch small ops, as on CUDA
            logits = [driver.extend({"a": [1, 2, 3, 4, 5, 6, 7], "b": [8, 9, 10]})]
            logits.append(driver.extend({"a": [11, 12], "b": [13, 14, 15, 16]}))
            for step in range(2):
                logits.append(driver.decode({"a": 20 + step, "b": 30 + step}))
        pool = runner.token_to_kv_pool
        return logits, pool.k_buffer + pool.v_buffer

    fused_logits, fused_kv = run()
    assert fused_launches
    monkeypatch.setattr(LlamaAttention, "fused_kv_write", lambda *a: None)
    separate_logits, separate_kv = run()
    for fused, separate in zip(fused_logits + fused_kv, separate_logits + separate_kv, strict=True):
        assert torch.equal(fused, separate)
