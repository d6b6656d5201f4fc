"""The native fused small ops inside the CPU forward (RMSNorm, RMSNorm + residual add, rotary, KV
write, SiLU-and-mul): the modules equal their torch path, and tiny models give the same logits and greedy tokens
with the native small ops on and off."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from model_utils import ModelDriver, make_runner, save_tiny_model

from radixengine.layers.activation import SiluAndMul
from radixengine.layers.attention import native_cpu_ops
from radixengine.layers.attention.base_attn_backend import save_kv
from radixengine.layers.layernorm import RMSNorm
from radixengine.layers.native_small_ops import ENV_VAR, native_small_ops, runs_native
from radixengine.layers.rotary_embedding import RotaryEmbedding
from radixengine.mem_cache.memory_pool import MHATokenToKVPool

pytestmark = pytest.mark.skipif(
    not native_cpu_ops.native_available(),
    reason=f"native CPU ops not built: {native_cpu_ops.native_unavailable_reason()}",
)

# bfloat16: the kernels round where torch rounds, but sum in another order (one bf16 ulp apart).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def _norm(hidden: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.3 * torch.randn(hidden))
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 100), (3, 5, 64)], ids=["rows", "heads"])
@torch.no_grad()
def test_rms_norm_equals_torch_path(dtype, shape):
    norm = _norm(shape[-1], dtype)
    x = torch.randn(*shape).to(dtype)
    with native_small_ops(False):
        expected = norm(x)
    assert runs_native(x, norm.weight)
    torch.testing.assert_close(norm(x), expected, **TOL[dtype])
    # A strided head slice (as Qwen3's q_norm gets) is normed, the tensor left as it was.
    qk = torch.randn(4, 6, 64).to(dtype)
    before = qk.clone()
    head_norm = _norm(64, dtype)
    with native_small_ops(False):
        expected = head_norm(qk[:, :4])
    torch.testing.assert_close(head_norm(qk[:, :4]), expected, **TOL[dtype])
    assert torch.equal(qk, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 32, 300])
@torch.no_grad()
def test_fused_add_rms_norm_equals_torch_path_in_place(dtype, tokens):
    norm = _norm(576, dtype)
    x, residual = torch.randn(tokens, 576).to(dtype), torch.randn(tokens, 576).to(dtype)
    with native_small_ops(False):
        expected_out, expected_sum = norm(x, residual)
    x_in, residual_in = x.clone(), residual.clone()
    out, total = norm(x_in, residual_in)
    assert out is x_in and total is residual_in  # SGLang's in-place contract
    torch.testing.assert_close(total, expected_sum, rtol=0, atol=0)
    torch.testing.assert_close(out, expected_out, **TOL[dtype])


@torch.no_grad()
def test_fused_add_rms_norm_keeps_torch_path_for_aliased_or_strided_inputs():
    norm = _norm(64, torch.float32)
    x = torch.randn(5, 64)
    expected_out, expected_sum = norm(x.clone(), x.clone())
    out, total = norm(x, x)  # the same tensor twice: the in-place kernel would clobber it
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(total, expected_sum)
    wide = torch.randn(5, 128)
    x_view, residual = wide[:, :64], torch.randn(5, 64)
    out, total = norm(x_view, residual)
    assert out is not x_view and total is not residual
    torch.testing.assert_close(total, x_view + residual)


def test_grad_tracking_keeps_torch_path():
    norm = _norm(64, torch.float32)
    x = torch.randn(3, 64, requires_grad=True)
    assert not runs_native(x, norm.weight)
    out = norm(x)
    assert out.requires_grad
    out.sum().backward()
    assert x.grad is not None


def _rope(head_size: int, rotary_dim: int, dtype: torch.dtype) -> RotaryEmbedding:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}  # fmt: skip
    return RotaryEmbedding(head_size, rotary_dim, 2048, 100000.0, dtype, scaling)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size,rotary_dim", [(64, 64), (64, 32), (80, 36)])
@torch.no_grad()
def test_rotary_equals_torch_path_in_place(dtype, head_size, rotary_dim):
    rope = _rope(head_size, rotary_dim, dtype)
    num_heads, num_kv_heads, tokens = 6, 2, 33
    qkv = torch.randn(tokens, num_heads + 2 * num_kv_heads, head_size).to(dtype)
    qk = qkv[:, : num_heads + num_kv_heads]  # a strided view, as the models pass it
    positions = torch.randint(0, 2048, (tokens,))
    with native_small_ops(False):
        expected = rope(positions, qk)
    v_before = qkv[:, num_heads + num_kv_heads :].clone()
    out = rope(positions, qk)
    assert out is qk
    torch.testing.assert_close(out, expected, **TOL[dtype])
    assert torch.equal(qkv[:, num_heads + num_kv_heads :], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(7, 3072), (1, 20), (0, 64), (2, 3, 64)], ids=["rows", "tail", "empty", "3d"]
)
@torch.no_grad()
def test_silu_and_mul_equals_torch_path(dtype, shape, native_calls):
    x = (3 * torch.randn(*shape)).to(dtype)
    with native_small_ops(False):
        expected = SiluAndMul()(x)
    out = SiluAndMul()(x)
    assert native_calls["silu_and_mul"] == (len(shape) == 2)  # 3-D input keeps the torch path
    assert out.shape == expected.shape and out.dtype == dtype
    torch.testing.assert_close(out, expected, **TOL[dtype])
    # A strided row view (every other row) reads through its stride.
    if len(shape) == 2 and shape[0] > 1:
        torch.testing.assert_close(SiluAndMul()(x[::2]), expected[::2], **TOL[dtype])


@pytest.mark.parametrize("cache_dtype", [*DTYPES, torch.float16])
@torch.no_grad()
def test_save_kv_equals_pool_write(cache_dtype):
    num_kv_heads, head_dim, tokens = 3, 64, 9
    pools = [MHATokenToKVPool(64, 1, cache_dtype, num_kv_heads, head_dim, 2, "cpu") for _ in range(2)]
    qkv = torch.randn(tokens, 4 + 2 * num_kv_heads, head_dim)
    k, v = qkv[:, 4 : 4 + num_kv_heads], qkv[:, 4 + num_kv_heads :]
    loc = torch.randperm(63)[:tokens] + 1
    layer = SimpleNamespace(layer_id=1)
    save_kv(k, v, layer, SimpleNamespace(token_to_kv_pool=pools[0], out_cache_loc=loc))
    with native_small_ops(False):
        save_kv(k, v, layer, SimpleNamespace(token_to_kv_pool=pools[1], out_cache_loc=loc))
    for native_buf, torch_buf in zip(pools[0].get_kv_buffer(1), pools[1].get_kv_buffer(1)):
        assert torch.equal(native_buf, torch_buf)
        assert native_buf[loc].abs().sum() > 0


# Through the ModelRunner --------------------------------------------------------------------------

ARCHS = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"small-ops-{request.param}")
    save_tiny_model(request.param, folder, seed=11 + ARCHS.index(request.param))
    return folder


@pytest.fixture
def native_calls(monkeypatch) -> dict[str, int]:
    """Counts the calls into the native small ops (which still run)."""
    calls = dict.fromkeys(
        ["rms_norm", "fused_add_rms_norm", "rotary_embedding", "set_kv_buffer", "silu_and_mul"], 0
    )
    for name in calls:
        real = getattr(native_cpu_ops, name)

        def counted(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(native_cpu_ops, name, counted)
    return calls


def _greedy_run(
    folder, backend: str, native: bool, steps: int = 6
) -> tuple[list[torch.Tensor], list[list[int]]]:
    driver = ModelDriver(make_runner(folder, page_size=1, attention_backend=backend))
    rng = random.Random(5)
    prompts = {f"r{i}": [rng.randrange(256) for _ in range(n)] for i, n in enumerate([29, 4, 13, 1])}
    cuts = {rid: max(1, len(t) // 2) for rid, t in prompts.items()}
    logits_per_step, tokens = [], []
    with native_small_ops(native):
        driver.extend({rid: t[: cuts[rid]] for rid, t in prompts.items()})
        logits = driver.extend({rid: t[cuts[rid] :] for rid, t in prompts.items() if len(t) > cuts[rid]})
        logits = torch.cat([logits[:3], driver.extend({"r3": [7]})])
        for _ in range(steps):
            logits_per_step.append(logits)
            next_ids = logits.argmax(-1).tolist()
            tokens.append(next_ids)
            logits = driver.decode(dict(zip(driver.reqs, next_ids)))
    return logits_per_step, tokens


@pytest.mark.parametrize("backend", ["native_cpu", "torch_native"])
def test_model_native_small_ops_on_equals_off(tiny, backend, native_calls):
    ref_logits, ref_tokens = _greedy_run(tiny, backend, native=False)
    assert not any(native_calls.values())
    logits, tokens = _greedy_run(tiny, backend, native=True)
    assert all(native_calls.values()), native_calls
    assert tokens == ref_tokens
    for ours, ref in zip(logits, ref_logits):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_env_switch_turns_native_small_ops_off():
    code = "from radixengine.layers.native_small_ops import native_small_ops_enabled as f; print(f())"
    outputs = {}
    for value in ("0", "1"):
        env = dict(os.environ, **{ENV_VAR: value})
        run = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outputs[value] = run.stdout.strip()
    assert outputs == {"0": "False", "1": "True"}
