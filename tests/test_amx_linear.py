"""bf16 linears on AMX tiles (layers/amx_linear.py, csrc/cpu_amx_linear.cpp): the packed layout,
the kernel against its pure-torch reference and against F.linear, and a model whose linears run
on it against the same model on oneDNN. The kernel tests skip where the CPU has no AMX."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from radixengine.layers.amx_linear import (
    AmxWeight,
    amx_linear_reference,
    amx_linear_unavailable_reason,
    amx_pack_linear_weight_reference,
    pack_amx_linears,
    unpack_linear_weight,
)
from radixengine.layers.attention import native_cpu_ops
from tests.model_utils import assert_runners_agree, make_runner, save_tiny_model

needs_amx = pytest.mark.skipif(
    amx_linear_unavailable_reason() is not None, reason=f"AMX linears: {amx_linear_unavailable_reason()}"
)


def _bf16(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


def test_reference_layout_puts_each_weight_where_the_tiles_read_it():
    w = torch.arange(64 * 96, dtype=torch.float32).view(64, 96).to(torch.bfloat16)
    packed = amx_pack_linear_weight_reference(w)
    assert packed.shape == (2, 3, 2, 16, 16, 2)
    for n, k in [(0, 0), (17, 5), (33, 64), (63, 95), (48, 31)]:
        nb, t, c = n // 32, n % 32 // 16, n % 16
        kb, p, e = k // 32, k % 32 // 2, k % 2
        assert packed[nb, kb, t, p, c, e] == w[n, k]
    assert torch.equal(unpack_linear_weight(packed), w)


def test_reference_equals_a_float32_matmul_rounded_once():
    w, x, b = _bf16(96, 64), _bf16(5, 64, seed=1), _bf16(96, seed=2)
    got = amx_linear_reference(x, amx_pack_linear_weight_reference(w), b)
    assert torch.equal(got, (x.float() @ w.float().T + b.float()).to(torch.bfloat16))


@needs_amx
def test_native_packing_equals_the_reference():
    native = native_cpu_ops.require_native()
    for n, k in [(32, 32), (96, 64), (3072, 576)]:
        w = _bf16(n, k, seed=n)
        assert torch.equal(native.amx_pack_linear_weight(w), amx_pack_linear_weight_reference(w))


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 31, 32, 33, 48, 100, 300])
@pytest.mark.parametrize("shape", [(32, 32), (96, 64), (576, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_equals_the_reference(rows, shape, with_bias):
    n, k = shape
    w, x = _bf16(n, k, seed=rows), _bf16(rows, k, seed=rows + 1)
    bias = _bf16(n, seed=3) if with_bias else None
    weight = AmxWeight.pack(w)
    got = weight.linear(x, bias).float()
    want = amx_linear_reference(x, weight.packed, bias).float()
    # Both sum in float32, in other orders: at most one bf16 rounding step apart.
    torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(got, F.linear(x, w, bias).float(), rtol=2**-7, atol=1e-2)


@needs_amx
def test_kernel_keeps_leading_dims_and_nan_stays_in_its_row():
    w = _bf16(64, 64)
    x = _bf16(2, 3, 64, seed=4)
    x[1, 2, 7] = float("nan")
    y = AmxWeight.pack(w).linear(x)
    assert y.shape == (2, 3, 64)
    assert torch.isnan(y[1, 2]).all()
    assert not torch.isnan(y.view(6, 64)[:5]).any()


@needs_amx
def test_kernel_refuses_a_weight_of_another_width():
    native = native_cpu_ops.require_native()
    packed = native.amx_pack_linear_weight(_bf16(32, 64))
    with pytest.raises(RuntimeError, match="K = 32"):
        native.amx_linear(_bf16(4, 32), packed)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        native.amx_pack_linear_weight(_bf16(40, 64))


def test_switch_off_names_itself(monkeypatch):
    monkeypatch.setenv("RADIXENGINE_AMX_LINEAR", "0")
    assert amx_linear_unavailable_reason() == "RADIXENGINE_AMX_LINEAR=0"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_amx")
    save_tiny_model("llama", path, tie_word_embeddings=True)
    return path


@needs_amx
def test_model_on_amx_linears_matches_onednn(folder, monkeypatch):
    runner = make_runner(folder, dtype="bfloat16", attention_backend="native_cpu")
    assert runner.amx_linears > 0
    linears = [m for m in runner.model.modules() if getattr(m, "amx_weight", None) is not None]
    assert all(m.weight is None for m in linears if not m.keeps_float_weight())
    monkeypatch.setenv("RADIXENGINE_AMX_LINEAR", "0")
    monkeypatch.setenv("RADIXENGINE_DPBF16_LINEAR", "0")  # AMX CPUs have AVX512-BF16 too
    plain = make_runner(folder, dtype="bfloat16", attention_backend="native_cpu")
    assert plain.amx_linears == 0 and plain.linear_kernel == "torch"
    assert_runners_agree(runner, plain)


def test_pack_skips_what_the_kernel_cannot_take(folder):
    runner = make_runner(folder, dtype="float32")
    assert runner.amx_linears == 0
    assert pack_amx_linears(runner.model) == 0  # float32 weights: nothing to pack
    assert all(getattr(m, "amx_weight", None) is None for m in runner.model.modules())


def test_worker_info_reports_the_packed_linears(folder):
    from radixengine.model_executor.tp_worker import TpModelWorker

    fp32 = TpModelWorker(make_runner(folder).server_args)
    assert fp32.get_worker_info().amx_linear_layers == 0
    if amx_linear_unavailable_reason() is None:
        bf16 = TpModelWorker(make_runner(folder, dtype="bfloat16").server_args)
        assert bf16.get_worker_info().amx_linear_layers == bf16.model_runner.amx_linears > 0


@needs_amx
def test_an_untied_embedding_is_not_packed(tmp_path):
    save_tiny_model("llama", tmp_path, tie_word_embeddings=False)
    model = make_runner(tmp_path, dtype="bfloat16").model
    assert model.model.embed_tokens.amx_weight is None and model.model.embed_tokens.weight is not None
    assert model.lm_head.amx_weight is not None and model.lm_head.weight is None


@needs_amx
def test_a_tied_lm_head_is_packed_and_keeps_the_table(folder):
    model = make_runner(folder, dtype="bfloat16").model
    assert model.lm_head is model.model.embed_tokens
    assert model.lm_head.amx_weight is not None and model.lm_head.weight is not None
